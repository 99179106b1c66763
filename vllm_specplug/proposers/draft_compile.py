"""The drafter's dense steps compiled with `torch.compile` (option `draft_compile`).

A drafting pass runs the head's one layer once per draft step, and each run
is a few dozen small kernels: the norms' casts, the rotary embedding, SiLU
times the up projection, the residual adds (`draft_layers.py`). On the H200
our chain's drafting pass took 1.3-2.3x the GPU time of vLLM's `eagle3`
pass at batch 16 and 64 (docs/results/v2_fused_step_h200), whose head vLLM
compiles with inductor, which fuses such elementwise work into fewer
kernels. Here the same compiler takes the three dense steps of a layer
(`qkv`, `finish`, `logits`); the attention over the cache and the top-k
stay our own kernels between them. Shapes are dynamic (one compile serves
every batch), and a captured drafting pass replays the compiled kernels
(its warm-up run, before the capture, compiles them).

On the H200 (a SmolLM2-shaped head, bf16, 256 cached positions) the
graphed drafting pass took 0.30-0.35 ms for a chain of 5 against 0.39-0.43
eager (1.21-1.30x), 1.08-1.13x for a tree of 16, at batch 1 / 16 / 64
(docs/results/draft_compile_h200).

Selection only: the drafts may differ in the last bits of a logit, never
what is verified, so it is lossless. A step whose compile or run fails
logs why and runs eagerly from then on.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("vllm_specplug.draft_compile")

COMPILED_STEPS = ("qkv", "finish", "logits")


class CompiledStep:
    """`fn` compiled (dynamic shapes) on first call; eager `fn` once a
    compile or a compiled run has failed."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name, self.eager = name, fn
        self.compiled: Callable | None = torch.compile(fn, dynamic=True)
        self.num_calls = 0

    def __call__(self, *args):
        if self.compiled is None:
            return self.eager(*args)
        try:
            out = self.compiled(*args)
        except Exception as error:  # noqa: BLE001 - the drafter goes on, eagerly
            logger.warning("vllm-specplug: draft_compile: the drafter's %s step failed "
                           "compiled (%s: %s); it runs eagerly from now on", self.name,
                           type(error).__name__, error)
            self.compiled = None
            return self.eager(*args)
        self.num_calls += 1
        return out


def compiled_steps(layer) -> dict[str, CompiledStep]:
    """{step: the layer's step, compiled} for `COMPILED_STEPS` of a
    `draft_layers` drafter."""
    return {name: CompiledStep(name, getattr(layer, name)) for name in COMPILED_STEPS}


def compile_status(steps: dict[str, CompiledStep]) -> dict[str, int | None]:
    """{step: calls served compiled; None once it fell back to eager}."""
    return {name: step.num_calls if step.compiled is not None else None
            for name, step in steps.items()}
