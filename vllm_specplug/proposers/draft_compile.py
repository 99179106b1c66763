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

With CUDA graphs the compiled steps serve the captured passes only (their
warm-up compiles them before each capture); what runs eagerly in service
(a prefill's ingest, a pass under a grammar hook) runs the eager steps. A
compile in service stalls its step: dynamic shapes still specialise a size
of 1 and each new argument pattern, and on the H200 a batch-64 step with
prefills once took 315 ms (docs/results/v2_tiny3_prof_h200). Each step's
compiled variants are counted (`compile_variants`), so that `bench offline`
reports any compiled in service beside our Triton kernels.

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
    compile or a compiled run has failed, and wherever `serves()` is False
    (given: the compiled step serves captured passes only)."""

    def __init__(self, name: str, fn: Callable, serves: Callable[[], bool] | None = None
                 ) -> None:
        self.name, self.eager, self.serves = name, fn, serves
        self.compiled: Callable | None = torch.compile(fn, dynamic=True)
        self.num_calls = 0

    def __call__(self, *args):
        if self.compiled is None or (self.serves is not None and not self.serves()):
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

    def num_variants(self) -> int | None:
        """Compiled variants of the step so far (dynamo's cache entries for
        its code: one per specialisation); None where they cannot be read."""
        try:
            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

            return len(_debug_get_cache_entry_list(self.eager.__func__.__code__))
        except Exception:  # noqa: BLE001 - a private API: counting is best effort
            return None


def compiled_steps(layer, serves: Callable[[], bool] | None = None
                   ) -> dict[str, CompiledStep]:
    """{step: the layer's step, compiled} for `COMPILED_STEPS` of a
    `draft_layers` drafter; `serves`: see `CompiledStep`."""
    return {name: CompiledStep(name, getattr(layer, name), serves) for name in COMPILED_STEPS}


def compile_status(steps: dict[str, CompiledStep]) -> dict[str, int | None]:
    """{step: calls served compiled; None once it fell back to eager}."""
    return {name: step.num_calls if step.compiled is not None else None
            for name, step in steps.items()}


def compile_variants(steps: dict[str, CompiledStep]) -> dict[str, int]:
    """{"compiled <step>": its compiled variants} where they can be read."""
    counts = {f"compiled {name}": step.num_variants() for name, step in steps.items()}
    return {name: n for name, n in counts.items() if n is not None}
