"""Build, drive and stop real `vllm.LLM` engines with this project's defaults.

Product code (the `demo`, `bench` and `extract` commands) and the test harness
(`vllm_specplug.testing`, which builds on this module) share these defaults.
vLLM spawns processes: every script that calls `make_llm` needs an
`if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# Small KV cache (GiB): our models are tiny and several engines may live at once.
DEFAULT_KVCACHE_GIB = "1"
DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_MAX_NUM_SEQS = 64


def set_cpu_defaults() -> None:
    """Environment defaults for vLLM's CPU platform (a caller's values win)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_GIB)
    # Several engines may run at once on a 2-core machine: engines that each
    # pin their OpenMP threads would be pinned onto the same cores.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def make_llm(model_dir: str | Path, speculative_config: dict | None = None,
             **kwargs: Any):
    """A real engine with our defaults: eager, fp32, stats on, fixed seed.

    Keyword arguments are `vllm.LLM`'s and override the defaults.
    """
    set_cpu_defaults()
    from vllm import LLM

    options: dict[str, Any] = dict(
        model=str(model_dir), dtype="float32", enforce_eager=True, seed=0,
        max_model_len=DEFAULT_MAX_MODEL_LEN, disable_log_stats=False,
        max_num_seqs=DEFAULT_MAX_NUM_SEQS)
    options.update(kwargs)
    if speculative_config is not None:
        options["speculative_config"] = speculative_config
    return LLM(**options)


def shutdown_llm(llm) -> None:
    """Stop the engine-core process now rather than at interpreter exit."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()


@contextmanager
def running_llm(model_dir, speculative_config=None, **kwargs) -> Iterator[Any]:
    llm = make_llm(model_dir, speculative_config, **kwargs)
    try:
        yield llm
    finally:
        shutdown_llm(llm)


def greedy_params(max_tokens: int, **kwargs: Any):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@dataclass
class GenerationResult:
    token_ids: list[list[int]]
    texts: list[str]
    seconds: float

    @property
    def num_output_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds


def generate(llm, prompts: list, sampling_params, use_tqdm: bool = False
             ) -> GenerationResult:
    """Generate for all prompts (text or `TokensPrompt`s) in one batch; keep
    output order."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling_params, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - start
    return GenerationResult([list(o.outputs[0].token_ids) for o in outputs],
                            [o.outputs[0].text for o in outputs], seconds)
