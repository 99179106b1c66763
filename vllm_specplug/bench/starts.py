"""Starting a bench's engines: one at a time, or all at once (`--parallel-starts`).

An engine's start is mostly the work of its own engine-core process: vLLM
loads the model, compiles it and captures its CUDA graphs there. On the
H200 that took 80-120 s an engine, and six engines took 9 minutes of a
30-minute lease before the first measured repeat
(docs/results/v2_mtp_sized_h200). Those processes can run side by side.
What the calling process does for an engine (`vllm.LLM`'s configuration,
its stat logger) takes it a few seconds. So, all at once, each engine is
made and warmed up in a thread of its own.

Four things of this process are shared between engines, and made at once
they would race:
- **Engine cores in this process** (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
  as the test suite runs them: `engine.InProcessEngines`). Such cores share
  vLLM's process-wide state; in CI two of them running their forwards in
  two threads aborted the process. Every core started at once runs in a
  process of its own (`engine.cores_in_own_processes`).
- **vLLM's general plugins** (ours add our methods to vLLM's speculative
  config). They are loaded once before the threads, so that no thread
  builds a config before they are in.
- **vLLM's Prometheus collectors.** Each new stat logger unregisters every
  `vllm:` collector and registers its own (`unregister_vllm_metrics`).
  Made at once, loggers remove each other's halfway and register
  duplicates. `metrics.collectors_by_thread` keeps each thread's own and
  lets the latest registration of a name win.
- **GPU memory.** vLLM sizes an engine's KV cache from the whole device's
  free memory before and after its profiling run, which the other
  engines' starts change. On CUDA, engines started at once get a KV cache
  of `kv_cache_memory_bytes` (vLLM then skips that measurement): the
  caller's, or half of each engine's share of the device
  (`KV_CACHE_SHARE` of its `gpu_memory_utilization`), leaving the other
  half to its weights, graphs and activations. A model whose weights need
  more passes its own.

An engine whose start fails among the others is started again alone, after
them (`run_offline` starts every engine it does not hold yet).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from vllm_specplug.bench.specs import NamedSpec
from vllm_specplug.bench.worker_info import engine_record
from vllm_specplug.engine import cores_in_own_processes, generate, running_llm
from vllm_specplug.metrics import collectors_by_thread

logger = logging.getLogger("vllm_specplug.bench")
NUM_WARMUP_PROMPTS = 2
KV_CACHE_SHARE = 0.5  # of an engine's share of the GPU, when started with the others


def start_engine(stack: ExitStack, model: str, spec: NamedSpec, engine_kwargs: dict, prompts,
                 rows: list) -> object | None:
    """The spec's running engine, after two prompts of 8 tokens; None, with
    its rows' `error` set, if it fails (one bad config must not lose the
    others)."""
    from vllm import SamplingParams

    kwargs = {**engine_kwargs, **spec.engine_kwargs}
    try:
        llm = stack.enter_context(running_llm(model, spec.config, **kwargs))
        generate(llm, [p.input_for(llm.get_tokenizer()) for p in prompts[:NUM_WARMUP_PROMPTS]],
                 SamplingParams(temperature=0, max_tokens=8))
    except Exception as error:
        logger.error("spec %s failed: %s", spec.name, error)
        for row in rows:
            row.error = f"{type(error).__name__}: {error}"
        return None
    record = engine_record(llm, kwargs)
    for row in rows:
        row.engine = record
    return llm


def check_parallel_starts(order: str) -> None:
    """A clear error where engines cannot start at once: another order than
    interleaved (only it keeps every engine alive)."""
    if order != "interleaved":
        raise ValueError(f"--parallel-starts starts every engine at once: it needs --order "
                         f"interleaved, not {order!r}")


def kv_cache_bytes(utilization: float, total_memory: int) -> int:
    """The KV cache of an engine started with the others: `KV_CACHE_SHARE`
    of its share of the device (`utilization` of `total_memory` bytes)."""
    return int(KV_CACHE_SHARE * utilization * total_memory)


def with_kv_cache_size(engine_kwargs: dict) -> dict:
    """On CUDA, `engine_kwargs` with `kv_cache_memory_bytes` where the caller
    set none (`kv_cache_bytes` of its `gpu_memory_utilization`, vLLM's 0.9
    if unset); elsewhere (vLLM's CPU backend sizes its cache from
    VLLM_CPU_KVCACHE_SPACE) as they are."""
    if engine_kwargs.get("kv_cache_memory_bytes"):
        return engine_kwargs
    import torch

    if not torch.cuda.is_available():
        return engine_kwargs
    # a device query, no allocation; vLLM's engine cores start with spawn
    # where this process has CUDA initialised
    size = kv_cache_bytes(engine_kwargs.get("gpu_memory_utilization", 0.9),
                          torch.cuda.get_device_properties(0).total_memory)
    logger.info("engines started at once: a KV cache of %.1f GB each", size / 1e9)
    return {**engine_kwargs, "kv_cache_memory_bytes": size}


def start_all(stacks: dict[int, ExitStack], model: str, specs: list[NamedSpec],
              engine_kwargs: dict, prompts, rows: list[list], warm_up) -> dict[int, tuple]:
    """Every spec's engine started at once, each in a thread that then runs
    `warm_up(llm, spec_index)`: {spec index: (engine, its vLLM collectors)}
    for those that started. A spec that failed is left out, its rows' error
    cleared and its stack closed, to be started again alone."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # before any thread builds a config

    def start(s: int):
        llm = start_engine(stacks[s], model, specs[s], engine_kwargs, prompts, rows[s])
        found = recorder.collectors()
        if llm is None:
            logger.warning("spec %s: its engine will be started again, alone", specs[s].name)
            stacks[s].close()
            for row in rows[s]:
                row.error = None
            return None
        warm_up(llm, s)
        return llm, found

    with cores_in_own_processes(), collectors_by_thread() as recorder, \
            ThreadPoolExecutor(len(specs)) as pool:
        started = list(pool.map(start, range(len(specs))))
    return {s: pair for s, pair in enumerate(started) if pair is not None}
