"""Build, drive and stop real `vllm.LLM` engines with this project's defaults.

Product code (the `demo`, `bench` and `extract` commands) and the test harness
(`vllm_specplug.testing`, which builds on this module) share these defaults.
vLLM spawns processes: every script that calls `make_llm` needs an
`if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger("vllm_specplug.engine")
# Small KV cache (GiB): our models are tiny and several engines may live at once.
DEFAULT_KVCACHE_GIB = "1"
DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_MAX_NUM_SEQS = 64


def set_cpu_defaults(num_ranks: int = 1) -> None:
    """Environment defaults for vLLM's CPU platform (a caller's values win)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_GIB)
    # Several engines may run at once on a 2-core machine: engines that each
    # pin their OpenMP threads would be pinned onto the same cores. A sharded
    # target's ranks are bound to CPUs of their own instead (the plugin
    # splits them where vLLM cannot: integration/cpu_threads.py).
    if num_ranks == 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class InProcessEngines:
    """Engines whose core runs in this process.

    With `VLLM_ENABLE_V1_MULTIPROCESSING=0` vLLM runs the engine core in the
    caller's process: an engine starts in 2-3 s instead of 20-30 on a 2-core
    machine. Such engines share process-wide state: vLLM's distributed
    groups, which the first one to shut down destroys under the others
    (`EngineCore.shutdown`), and the worker class, into which vLLM mixes a
    worker extension for good (`WorkerWrapperBase.init_worker`). So while
    one is alive, another engine gets a core process of its own, and a
    stopped one takes its worker extension back out. Process-wide by
    nature, like the state it guards.
    """

    def __init__(self) -> None:
        self.live: weakref.WeakSet = weakref.WeakSet()

    @staticmethod
    def requested() -> bool:
        import vllm.envs

        return not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING

    def start(self, options: dict, own_process: bool):
        from vllm import LLM

        if not self.requested():  # vLLM's default: every core has its own process
            return LLM(**options)
        reason = self._own_process_reason(own_process)
        if reason is None:
            llm = LLM(**options)
            self.live.add(llm)
            return llm
        logger.info("vllm-specplug: this engine's core runs in its own process (%s)", reason)
        with cores_in_own_processes():
            return LLM(**options)

    def _own_process_reason(self, own_process: bool) -> str | None:
        """Why this engine's core must run in a process of its own (None:
        it may run here)."""
        if own_process:
            return "asked"
        if len(self.live):
            return "another engine's core runs in this process"
        if "llvmlite" in sys.modules:  # numba's, e.g. under vLLM's n-gram proposer
            # vLLM's CPU kernel registration scans every loaded module
            # (`dispatcher._rebind_kernels`) and fails on llvmlite's objects
            return "llvmlite is loaded in this process"
        return None

    def stopped(self, llm) -> None:
        if llm in self.live:
            self.live.discard(llm)
            _remove_worker_extension(llm)


IN_PROCESS = InProcessEngines()


@contextmanager
def cores_in_own_processes() -> Iterator[None]:
    """Every engine made inside runs its core in a process of its own, also
    where `VLLM_ENABLE_V1_MULTIPROCESSING=0` asks for this one. Engines
    started at once in threads (bench/starts.py) need it: in-process cores
    share vLLM's process-wide state (a CPU forward of one engine aborted
    the process while another's ran). Set once around them all: the
    variable is process-wide, and threads saving and restoring it each
    would restore it under each other."""
    import vllm.envs

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    vllm.envs.disable_envs_cache()  # an in-process core cached the variables
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
        vllm.envs.disable_envs_cache()


def _remove_worker_extension(llm) -> None:
    """Take the worker extension vLLM mixed into the worker class back out,
    so that the next in-process engine may bring another."""
    config = llm.llm_engine.vllm_config.parallel_config
    if not config.worker_extension_cls or not isinstance(config.worker_cls, str):
        return
    worker_cls = _by_qualname(config.worker_cls)
    extension = _by_qualname(config.worker_extension_cls)
    worker_cls.__bases__ = tuple(b for b in worker_cls.__bases__ if b is not extension)


def _by_qualname(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def make_llm(model_dir: str | Path, speculative_config: dict | None = None,
             own_process: bool = False, **kwargs: Any):
    """A real engine with our defaults: eager, fp32, stats on, fixed seed.

    Keyword arguments are `vllm.LLM`'s and override the defaults.
    `own_process`: the engine core runs in a process of its own even where
    `VLLM_ENABLE_V1_MULTIPROCESSING=0` asks for this one (`InProcessEngines`).
    """
    set_cpu_defaults(kwargs.get("tensor_parallel_size", 1)
                     * kwargs.get("pipeline_parallel_size", 1))
    options: dict[str, Any] = dict(
        model=str(model_dir), dtype="float32", enforce_eager=True, seed=0,
        max_model_len=DEFAULT_MAX_MODEL_LEN, disable_log_stats=False,
        max_num_seqs=DEFAULT_MAX_NUM_SEQS)
    options.update(kwargs)
    if speculative_config is not None:
        options["speculative_config"] = speculative_config
    return IN_PROCESS.start(options, own_process)


def shutdown_llm(llm) -> None:
    """Stop the engine-core process now rather than at interpreter exit."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    IN_PROCESS.stopped(llm)
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
    outputs: list = field(default_factory=list, repr=False)  # vLLM's RequestOutputs

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
                            [o.outputs[0].text for o in outputs], seconds, list(outputs))
