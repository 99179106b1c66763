"""What an engine of the benchmark actually ran: its runner and speculator,
asked inside the worker process (a runner or speculator can differ from what
the configuration suggests: vLLM falls back to its V1 runner for some methods)."""
from __future__ import annotations

WORKER_INFO_QUALNAME = "vllm_specplug.bench.worker_info.WorkerInfo"


class WorkerInfo:
    """A worker extension (`LLM(worker_extension_cls=WORKER_INFO_QUALNAME)`)."""

    def specplug_runner_state(self) -> dict:
        return runner_state(self)

    def specplug_adaptive_stats(self) -> dict | None:
        return adaptive_stats(self)

    def specplug_batch_policy(self) -> dict | None:
        """The batch draft length's counters as of the last step this worker
        ran (integration/batch_schedule.BatchPolicyView); None when off."""
        return getattr(_speculator(self), "batch_policy", None)

    def specplug_graph_captures(self) -> dict | None:
        """The head's CUDA graphs captured in service, after start-up's
        (proposers/head_graphs.PassGraphs.service_captures); None without."""
        return graph_captures(self)

    def specplug_prefix_stats(self) -> dict | None:
        return prefix_stats(self)

    def specplug_head_counters(self) -> dict | None:
        """Our head's prefix hits and prompt lookups so far (`head_counters`)."""
        return head_counters(self)

    def specplug_step_periods_start(self) -> None:
        """Every step's period from now on (bench/step_periods.py)."""
        from vllm_specplug.bench.step_periods import watch_step_periods

        watch_step_periods(self.model_runner)

    def specplug_step_periods_take(self) -> dict | None:
        """The periods since `specplug_step_periods_start`, summarised."""
        clock = getattr(self.model_runner, "_specplug_step_periods", None)
        return None if clock is None else clock.take()

    def specplug_phases_start(self, profile_gpu: bool, profile_host: bool = False) -> None:
        from vllm_specplug.bench.phases import start_probe

        start_probe(self, profile_gpu, profile_host)

    def specplug_phases_stop(self) -> dict:
        from vllm_specplug.bench.phases import stop_probe

        return stop_probe(self)


def runner_state(worker) -> dict:
    """Which model runner and speculator a worker runs, in which dtype (vLLM's
    `auto` runs a float32 checkpoint in bf16 on CPU), and its capture sizes."""
    runner, speculator = worker.model_runner, _speculator(worker)
    config = runner.vllm_config
    return {"runner": f"{type(runner).__module__}.{type(runner).__name__}",
            "speculator": None if speculator is None else type(speculator).__name__,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "async_scheduling": bool(config.scheduler_config.async_scheduling),
            "scheduler_cls": _qualname(config.scheduler_config.scheduler_cls),
            "cudagraph_capture_sizes":
                list(config.compilation_config.cudagraph_capture_sizes or []),
            "token_history": token_history_place(runner)}


def token_history_place(runner) -> str | None:
    """Where Model Runner V2 keeps the requests' token histories ("device" or
    "host": integration/v2/token_history.py); None on the V1 runner."""
    req_states = getattr(runner, "req_states", None)
    if req_states is None:
        return None
    from vllm_specplug.integration.v2.token_history import history_place

    return history_place(req_states)


def graph_captures(worker) -> dict | None:
    """`PassGraphs.service_captures` of the worker's head, None without one,
    with our kernels compiled in service by name (`kernel_compiles`:
    integration/v2/kernel_warmup.ServiceCompiles; {} where not counted) and,
    under draft_compile, each step's compiled variants so far ("compiled
    qkv": their difference over a pass is what it compiled)."""
    speculator = _speculator(worker)
    graphs = getattr(getattr(speculator, "runtime", None), "graphs", None)
    if graphs is None:
        return None
    compiles = getattr(speculator, "service_compiles", None)
    found = {**graphs.service_captures(),
             "kernel_compiles": dict(compiles.counts) if compiles is not None else {}}
    steps = getattr(speculator.runtime, "compiled_steps", None)
    if steps:  # draft_compile: each step's compiled calls, None where it fell back to eager
        from vllm_specplug.proposers.draft_compile import compile_status, compile_variants

        found["draft_compile"] = compile_status(steps)
        # variants compiled so far: `captures_delta` keeps those of a measured
        # pass, each a compile that stalled a step, beside our Triton kernels
        found["kernel_compiles"].update(compile_variants(steps))
    return found


def prefix_stats(worker) -> dict | None:
    """Our Model Runner V2 head speculator's prefix hits adopted, missed and
    filled so far (`PrefixBlocks.stats()`, integration/v2/prefix_blocks.py);
    None without that speculator or with prefix caching off."""
    prefix = getattr(getattr(worker.model_runner, "speculator", None), "prefix", None)
    return None if prefix is None else prefix.stats()


def head_counters(worker) -> dict | None:
    """`prefix_stats` and, where prompt lookups are on, the requests a lookup
    drafted and its nodes drafted so far (`lookup_rows`, `lookup_nodes`:
    `lookup_stats()` of our head's V2 speculator or V1 drafter); None
    without either."""
    counters = dict(prefix_stats(worker) or {})
    lookups = getattr(_speculator(worker), "lookup_stats", None)
    counters.update((lookups() or {}) if callable(lookups) else {})
    return counters or None


def adaptive_controller(worker):
    """The worker's `AdaptiveController` (vllm_specplug/adaptive/): the V1
    drafter's or the V2 speculator's session's, or the V1 tree drafter's
    `TreeBudget`; None when off or absent."""
    speculator = _speculator(worker)
    return getattr(getattr(speculator, "session", speculator), "adaptive", None)


def _speculator(worker):
    """The runner's speculator (Model Runner V2) or drafter (V1 runner)."""
    runner = worker.model_runner
    return getattr(runner, "speculator", None) or getattr(runner, "drafter", None)


def adaptive_stats(worker) -> dict | None:
    """The adaptive controller's decisions so far, None when it is off."""
    controller = adaptive_controller(worker)
    return None if controller is None else controller.as_dict()


def _qualname(cls_or_path) -> str | None:
    if cls_or_path is None or isinstance(cls_or_path, str):
        return cls_or_path
    return f"{cls_or_path.__module__}.{cls_or_path.__qualname__}"


def engine_record(llm, engine_kwargs: dict) -> dict:
    """The engine's arguments, and its worker's runner state where it can be
    asked (a user's own worker extension replaces ours)."""
    record = {"engine_args": {k: v for k, v in engine_kwargs.items()
                              if isinstance(v, (str, int, float, bool, type(None)))}}
    try:
        record.update(llm.collective_rpc("specplug_runner_state")[0])
    except Exception as error:  # the record is informative; the run goes on
        record["runner"] = f"unknown ({type(error).__name__})"
    return record
