"""Where Model Runner V2's steps make the host wait for the GPU, by step
kind and call site.

Under async scheduling the host prepares step n+1 while the GPU runs step
n. An operation that synchronises (a blocking copy from pageable memory, a
CUDA tensor indexed with a host array, `.item()`, a boolean-mask index,
`nonzero`) holds the host until the GPU's queue has drained, and the host
work after it no longer hides under the GPU's. PyTorch reports each one
under `torch.cuda.set_sync_debug_mode("warn")`. `watch_syncs(runner)` turns
that on around one runner's `execute_model` and `sample_tokens` (its own
methods, wrapped on the instance) and counts the reports by step kind
(`bench/step_kinds.py`) and by the Python line that made them, with each
line's first caller frames in vLLM and vllm-specplug.

On the H100 (SmolLM2, batch 16 and 64) vLLM's `eagle3` made none in its
steps; our head speculator made two in every step with a prefill, where its
eager ingest indexed the GPU's rows with a host array
(docs/results/v2_host_syncs_h100_s70). The probe is
`benchmarks/gpu/sync_probe.py`; `tests/gpu/test_host_syncs_cuda.py` fails
on any wait of ours.
"""
from __future__ import annotations

import functools
import traceback
import warnings
from collections import Counter, defaultdict

SYNC_MESSAGE = "synchroniz"  # PyTorch's report: "called a synchronizing CUDA operation"
OUR_PACKAGE = "/vllm_specplug/"
OWN_PATHS = (OUR_PACKAGE, "/vllm/")  # caller frames worth keeping
NUM_CALLER_FRAMES = 4
# this module: its frames wrap every step, so they say nothing of a site
PROBE_FILE = "/vllm_specplug/testing/host_syncs.py"


class SyncLog:
    """Reports of synchronising operations, by step kind and call site."""

    def __init__(self) -> None:
        self.kind = "start-up"
        self.num_steps: Counter = Counter()  # kind -> execute_model calls
        self.sites: dict[str, Counter] = defaultdict(Counter)  # kind -> site -> count
        self.callers: dict[str, list[str]] = {}  # site -> its first caller frames
        self.num_probe_reports = 0  # reports of the probe's own switch into "warn" mode

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        """`warnings.showwarning` while a step runs: a sync report is counted;
        any other warning of a watched step is left out (the probe's filter
        shows every warning every time, which would flood the log)."""
        if SYNC_MESSAGE not in str(message):
            return
        self.record(f"{filename}:{lineno}", traceback.extract_stack()[:-1])

    def record(self, site: str, stack: list) -> None:
        """One sync report at `site` ("file:line"), `stack` the frames that
        led to it (outermost first, as `traceback.extract_stack` gives them).
        A report whose innermost frame of ours is this module's is the
        probe's own: turning the mode on reported a synchronize once a
        process, at the first watched step (the H100's test run,
        docs/results/v2_host_syncs_test_h100_s71); it is counted apart.
        This module's frames are never a site's callers: they wrap every
        step, vLLM's syncs included."""
        own = [f for f in stack if any(p in f.filename for p in OWN_PATHS)]
        if own and PROBE_FILE in own[-1].filename:
            self.num_probe_reports += 1
            return
        self.sites[self.kind][site] += 1
        if site not in self.callers:
            frames = [f for f in own if PROBE_FILE not in f.filename]
            self.callers[site] = [f"{f.filename}:{f.lineno} {f.name}"
                                  for f in frames[-NUM_CALLER_FRAMES:]]

    def ours(self) -> dict[str, int]:
        """{site: count} over every step kind, of the sites in our package or
        called from it."""
        found: Counter = Counter()
        for sites in self.sites.values():
            for site, count in sites.items():
                if OUR_PACKAGE in site or any(OUR_PACKAGE in f for f in self.callers[site]):
                    found[site] += count
        return dict(found)

    def report(self) -> dict:
        return {"num_steps": dict(self.num_steps),
                "syncs": {kind: dict(sites.most_common()) for kind, sites in self.sites.items()},
                "callers": self.callers, "ours": self.ours(),
                "probe": self.num_probe_reports}


def watch_syncs(runner) -> SyncLog:
    """From now on, log the synchronising operations of `runner`'s steps
    (its `execute_model` and `sample_tokens`, wrapped on the instance);
    returns the log, also kept as `runner._specplug_sync_log`. Again on the
    same runner: a fresh log."""
    log = SyncLog()
    if hasattr(runner, "_specplug_sync_log"):
        runner._specplug_sync_log = log
        return log
    runner._specplug_sync_log = log
    runner.execute_model = _watched(runner, runner.execute_model, first=True)
    runner.sample_tokens = _watched(runner, runner.sample_tokens, first=False)
    return log


def _watched(runner, method, first: bool):
    import torch

    from vllm_specplug.bench.step_kinds import step_kind

    @functools.wraps(method)
    def step(*args, **kwargs):
        log = runner._specplug_sync_log
        if first:
            scheduler_output = args[0] if args else kwargs.get("scheduler_output")
            log.kind = step_kind(scheduler_output) or "empty"
            log.num_steps[log.kind] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = log.show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return method(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    return step
