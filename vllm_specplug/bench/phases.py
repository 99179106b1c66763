"""Where a decode step's time goes, measured inside the worker: host time of
each phase (wall time of the runner's call), and, under the PyTorch profiler,
GPU time and launches per phase. Issue 26 asks for it side by side for our
speculators and vLLM's.

Phases, by the model runner's own methods (wrapped on the instance while a
probe runs, so nothing of vLLM's code changes):

| phase | Model Runner V2 (CUDA) | V1 runner (CPU) |
| --- | --- | --- |
| step | `execute_model` + `sample_tokens` | the same |
| forward | `execute_model` (inputs, target forward) | `_model_forward` |
| verify | `sample` (sampler / rejection sampler) | `_sample` |
| draft | `speculator.propose` | `propose_draft_token_ids` |
| grammar | inside the phases above: `structured_outputs_worker.apply_grammar_bitmask`, `speculator.verification_rows`, `speculator.structured.{root_bitmask, path_masks, queue_outputs}` | - |
| ingest_prefills, ingest_decodes, draft_apart, adopt_prefixes, save_prefixes | our head speculator's steps with prefills: `speculator._ingest_prefills` (eager), `_ingest_decodes` and `_draft` (graphed), `_adopt_prefixes` (prefix-cache hits), `speculator.prefix.schedule` (finished requests' rows saved) | - |
| grammar_wait | the grammar's waits for the GPU: `take_draft_token_ids` (the drafts' host copy: inside our `verification_rows`, or vLLM's deferred step's RPC), `speculator.structured.{_queued_outputs, _outputs}` (the outputs' copy) | - |

(The engine core's grammar work, the rows vLLM's scheduler fills, runs in
another process: not in any phase.)

Our own code marks finer ranges (`specplug::compact_kv`, `specplug::ingest`,
`specplug::draft_tree`, `specplug::decode_step`, `specplug::keep_rows`,
`specplug::ingest_kept`; under structured outputs `specplug::root_masks`,
the first drafting step's masks, and `specplug::worker_rows`, the
verification rows filled in the worker) with `torch.profiler.record_function`; the profiler
reports them too. Under async scheduling the host runs ahead of the GPU, so
a phase's host time and its GPU time are different things: both are given.

With `host_profile`, a third pass runs under Python's cProfile (in the
worker's main thread, where the runner's calls run): the functions that take
the most host time per step, by their own time and by their cumulative
time. cProfile slows every Python call, so compare its rows with each
other, not with the timed pass.
"""
from __future__ import annotations

import cProfile
import pstats
import time
from bisect import bisect_left
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from vllm_specplug.bench.step_kinds import StepClock, step_kind

V2_PHASES = {"forward": ("", "execute_model"), "verify": ("", "sample"),
             "draft": ("speculator", "propose")}
# the grammar's own host work in the worker under structured outputs, inside
# the phases above (issue 30: its cost beside the step): vLLM's bitmask
# applied to the logits, and ours: the verification rows the worker fills,
# the first drafting step's masks, every step's masks, the outputs queued,
# greedy trees decided from the target's choices (grammar_verify "choices")
V2_GRAMMAR = (("structured_outputs_worker", "apply_grammar_bitmask"),
              ("speculator", "verification_rows"),
              ("speculator.structured", "root_bitmask"),
              ("speculator.structured", "path_masks"),
              ("speculator.structured", "queue_outputs"),
              ("speculator.grammar_choices", "correct"))
# where that work waits for the GPU (the drafts' or the outputs' copy to the
# host): on the H200 the worker's grammar phase was 7.5 ms a step at batch 64
# with 2 rows a request filled, far over their fill (docs/results/v2_row_depth_h200)
V2_GRAMMAR_WAIT = (("", "take_draft_token_ids"),
                   ("speculator.structured", "_queued_outputs"),
                   ("speculator.structured", "_outputs"),
                   ("speculator.grammar_choices", "host_choices"))
# our head speculator's parts of a step with prefills (issue 26: our first
# steps of a wave took twice vLLM's, docs/results/v2_tiny3_compile_h200):
# the prefills' eager ingest, the decodes' graphed ingest and the drafting
# pass apart from them, prefix-cache hits adopted, finished requests' rows
# saved; vLLM's speculators have none of them
V2_HEAD_PARTS = (("ingest_prefills", ("speculator", "_ingest_prefills")),
                 ("ingest_decodes", ("speculator", "_ingest_decodes")),
                 ("draft_apart", ("speculator", "_draft")),
                 ("adopt_prefixes", ("speculator", "_adopt_prefixes")),
                 ("save_prefixes", ("speculator.prefix", "schedule")))
V1_PHASES = {"forward": ("", "_model_forward"), "verify": ("", "_sample"),
             "draft": ("", "propose_draft_token_ids")}
STEP_METHODS = ("execute_model", "sample_tokens")
MARK_PREFIX = "specplug::"
LAUNCH_NAMES = ("LaunchKernel", "GraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
_NOT_OWN = object()  # a wrapped method that was the class's, not the instance's
NUM_TOP_FUNCTIONS = 150  # per ranking of a host profile (the table shows the first few)
NUM_TOP_GPU_OPS = 25  # device operations kept per profiled pass


@dataclass
class PhaseProbe:
    """Wrapped methods of one worker's model runner, and what they measured."""
    runner: object
    profile_gpu: bool
    profile_host: bool = False
    host_seconds: dict = field(default_factory=lambda: defaultdict(float))
    num_calls: dict = field(default_factory=lambda: defaultdict(int))
    wrapped: list = field(default_factory=list)  # (object, method name, its own attribute)
    profiler: object = None
    host_profiler: cProfile.Profile | None = None
    started: float = 0.0
    clock: StepClock = field(default_factory=StepClock)  # the steps by kind (step_kinds.py)

    def start(self) -> None:
        for target, method, phases in _phase_methods(self.runner):
            self._wrap(target, method, phases)
        if self.profile_gpu:
            self.profiler = torch.profiler.profile(activities=_activities())
            self.profiler.__enter__()
        if self.profile_host:
            self.host_profiler = cProfile.Profile()
            self.host_profiler.enable()
        self.started = time.perf_counter()

    def stop(self) -> dict:
        """Per decode step: host ms and calls per phase; with the profiler,
        GPU ms and launches per phase (and per `specplug::` range)."""
        wall = time.perf_counter() - self.started
        if self.host_profiler is not None:
            self.host_profiler.disable()
        if self.profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
        for target, method, own in self.wrapped:
            if own is _NOT_OWN:
                del target.__dict__[method]  # the class's method again
            else:
                setattr(target, method, own)  # the instance's own attribute back
        num_steps = max(self.num_calls["sample_tokens"], 1)
        result = {"num_steps": self.num_calls["sample_tokens"],
                  "wall_ms": 1e3 * wall / num_steps, "phases": {},
                  "step_kinds": self.clock.summary()}
        for phase, seconds in self.host_seconds.items():
            result["phases"][phase] = {"host_ms": 1e3 * seconds / num_steps,
                                       "calls": self.num_calls[phase] / num_steps}
        if self.profiler is not None:
            profiled, result["gpu_ms_by"] = _profiled(self.profiler)
            for phase, (gpu_us, launches) in profiled.items():
                entry = result["phases"].setdefault(phase, {})
                entry["gpu_ms"] = gpu_us / 1e3 / num_steps
                entry["launches"] = launches / num_steps
            result["top_gpu_ops"] = top_gpu_ops(self.profiler.key_averages(), num_steps)
        if self.host_profiler is not None:
            result["host_profile"] = host_profile_summary(self.host_profiler, num_steps)
        return result

    def _wrap(self, target, method: str, phases: list[str]) -> None:
        original = getattr(target, method)
        probe = self
        labels = [MARK_PREFIX + phase for phase in phases]

        def timed(*args, **kwargs):
            started = time.perf_counter()
            if method == "execute_model":  # args[0]: the scheduler output
                probe.clock.step(step_kind(args[0] if args else None), started)
            with ExitStack() as ranges:
                for label in labels:
                    ranges.enter_context(torch.profiler.record_function(label))
                try:
                    return original(*args, **kwargs)
                finally:
                    seconds = time.perf_counter() - started
                    for phase in phases:
                        probe.host_seconds[phase] += seconds
                        probe.num_calls[phase] += 1
                        probe.clock.add(phase, seconds)
                    probe.num_calls[method] += 1

        own = vars(target).get(method, _NOT_OWN)
        setattr(target, method, timed)  # on the instance: shadows the class's
        self.wrapped.append((target, method, own))


def _phase_methods(runner) -> list[tuple[object, str, list[str]]]:
    """[(object, method name, the phases its calls count for)] (keyed by the
    object's id: a speculator's parts need not be hashable)."""
    v2 = type(runner).__module__.startswith("vllm.v1.worker.gpu.")
    methods: dict[tuple, tuple] = {}
    for phase, (owner, method) in [("step", ("", m)) for m in STEP_METHODS] + list(
            (V2_PHASES if v2 else V1_PHASES).items()) + [
            ("grammar", where) for where in (V2_GRAMMAR if v2 else ())] + [
            ("grammar_wait", where) for where in (V2_GRAMMAR_WAIT if v2 else ())] + list(
            V2_HEAD_PARTS if v2 else ()):
        target = _owner(runner, owner)
        if target is not None and hasattr(target, method):
            methods.setdefault((id(target), method), (target, method, []))[2].append(phase)
    return list(methods.values())


def _owner(runner, path: str):
    """The object at dotted attribute `path` of `runner` ("": the runner);
    None where a link is missing (a speculator without grammars)."""
    target = runner
    for name in filter(None, path.split(".")):
        target = getattr(target, name, None)
    return target


def _activities():
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def _profiled(profiler) -> tuple[dict[str, tuple[float, int]], str]:
    """({phase: (GPU microseconds of the device operations it launched,
    launches)}, how they were attributed) over every `specplug::` range,
    nested ones included.

    A range's launches (`cudaLaunchKernel`, `cudaGraphLaunch`, copies) are
    host events under it; each device operation carries the correlation id
    of the launch that queued it, a graph replay's kernels that of its
    `cudaGraphLaunch` ("launch"). Linked to PyTorch ops instead, a replay's
    kernels link to none (a replay is no op): every graphed phase read about
    0 GPU ms on the H200; the range's copy on the device's timeline spans
    the idle gaps between its kernels, and, as the H200 showed
    (docs/results/v2_tiny3_aa_h200), holds only the kernels of no range
    nested in it. Where no operation matches a launch, each range gets the
    operations within its own device-side span ("span": nested ranges'
    kernels not included)."""
    events = list(profiler.events())
    operations = [event for event in events if not _on_host(event) and not _is_annotation(event)]
    device_us: dict[int, float] = defaultdict(float)
    for operation in operations:
        device_us[operation.id] += operation.time_range.end - operation.time_range.start
    ranges = [event for event in events if event.name.startswith(MARK_PREFIX)]
    launches = {id(r): _launches(r) for r in ranges if _on_host(r)}
    by_launch = any(launch.id in device_us for found in launches.values() for launch in found)
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    spans = sorted((o.time_range.start, o.time_range.end) for o in operations)
    starts = [start for start, _ in spans]
    for event in ranges:
        total = totals[event.name[len(MARK_PREFIX):]]
        if _on_host(event):
            total[1] += len(launches[id(event)])
            if by_launch:
                total[0] += sum(device_us.get(launch.id, 0.0) for launch in launches[id(event)])
        elif not by_launch:
            total[0] += _time_within(spans, starts, event.time_range)
    return {phase: tuple(total) for phase, total in totals.items()}, \
        "launch" if by_launch else "span"


def _is_annotation(event) -> bool:
    """A range's copy on the device's timeline (not a kernel or a copy)."""
    return bool(getattr(event, "is_user_annotation", False)) \
        or event.name.startswith(MARK_PREFIX)


def _time_within(operations: list[tuple[float, float]], starts: list[float], span) -> float:
    """Microseconds of the device operations ((start, end), sorted) that
    started within `span` (its .start, .end), each cut at the span's end."""
    total = 0.0
    for start, end in operations[bisect_left(starts, span.start):bisect_left(starts, span.end)]:
        total += min(end, span.end) - start
    return total


def _on_host(event) -> bool:
    """The host side of a profiled event (not its copy on the device's timeline)."""
    return str(getattr(event, "device_type", "DeviceType.CPU")).endswith("CPU")


def top_gpu_ops(averages, num_steps: int, num_ops: int = NUM_TOP_GPU_OPS) -> list[dict]:
    """The device operations (kernels, copies) with the most GPU time over a
    profiled pass, each {"name", "calls", "gpu_ms"} per step: what a phase's
    GPU time is made of (the profiler's averages by name; host ops left out,
    they would count their kernels twice, and so are annotated ranges such
    as our phases: on the device those span the idle time between their
    kernels too)."""
    rows = [{"name": avg.key[:160], "calls": avg.count / num_steps,
             "gpu_ms": avg.self_device_time_total / 1e3 / num_steps}
            for avg in averages
            if str(getattr(avg, "device_type", "")).endswith(("CUDA", "PrivateUse1"))
            and not getattr(avg, "is_user_annotation", False)
            and not avg.key.startswith(MARK_PREFIX) and avg.self_device_time_total > 0]
    return sorted(rows, key=lambda row: -row["gpu_ms"])[:num_ops]


def _launches(event) -> list:
    """The launch events (kernels, graph replays, copies) under a host event."""
    stack, found = list(event.cpu_children), []
    while stack:
        child = stack.pop()
        if any(name in child.name for name in LAUNCH_NAMES):
            found.append(child)
        stack.extend(child.cpu_children)
    return found


def host_profile_summary(profiler: cProfile.Profile, num_steps: int) -> dict:
    """{"own": [...], "cumulative": [...], "ours": [...]}: the top functions
    by own and by cumulative host time, and this package's by cumulative,
    each {"function", "calls", "own_ms", "cum_ms"} per step."""
    rows, ours = [], []
    for (path, line, name), (_, num_calls, own, cumulative, _) in \
            pstats.Stats(profiler).stats.items():
        where = "/".join(path.split("/")[-3:]) if path != "~" else "builtin"
        rows.append({"function": f"{where}:{line}({name})", "calls": num_calls / num_steps,
                     "own_ms": 1e3 * own / num_steps, "cum_ms": 1e3 * cumulative / num_steps})
        if "vllm_specplug" in path:  # ours apart: what a speculator's profile is read for
            ours.append(rows[-1])
    top = lambda found, key: sorted(found, key=lambda r: -r[key])[:NUM_TOP_FUNCTIONS]  # noqa: E731
    return {"own": top(rows, "own_ms"), "cumulative": top(rows, "cum_ms"),
            "ours": top(ours, "cum_ms")}


def start_probe(worker, profile_gpu: bool, profile_host: bool = False) -> None:
    if getattr(worker, "specplug_probe", None) is not None:
        raise RuntimeError("a phase probe is already running on this worker")
    worker.specplug_probe = PhaseProbe(worker.model_runner, profile_gpu, profile_host)
    worker.specplug_probe.start()


def stop_probe(worker) -> dict:
    probe = getattr(worker, "specplug_probe", None)
    if probe is None:
        raise RuntimeError("no phase probe is running on this worker (start it first)")
    worker.specplug_probe = None
    return probe.stop()


def probe(llm, generate_once, host_profile: bool = False) -> dict:
    """`generate_once()` twice under the phase probe of `llm`'s worker
    (`WorkerInfo` extension): {"timed": host times without the profiler,
    "profiled": GPU times and launches under it (it slows the host)}; with
    `host_profile` a third time, under cProfile ("host_profiled")."""
    measured = {}
    passes = [("timed", False, False), ("profiled", True, False)]
    for key, profile_gpu, profile_host in passes + (
            [("host_profiled", False, True)] if host_profile else []):
        llm.collective_rpc("specplug_phases_start", args=(profile_gpu, profile_host))
        try:
            generate_once()
        finally:
            measured[key] = llm.collective_rpc("specplug_phases_stop")[0]
    return measured
