"""The host-sync log's bookkeeping (`vllm_specplug.testing.host_syncs`), on
CPU: what the GPU test `tests/gpu/test_host_syncs_cuda.py` asserts on. The
reports themselves come from PyTorch's CUDA sync debug mode, GPU only."""
from __future__ import annotations

from vllm_specplug.testing.host_syncs import SyncLog

SYNC = "called a synchronizing CUDA operation"
OURS = "/site/vllm_specplug/proposers/eagle3_head.py"
VLLMS = "/site/vllm/v1/worker/gpu_worker.py"


def test_the_log_counts_sync_reports_by_kind_and_site_and_drops_the_rest():
    log = SyncLog()
    log.kind = "first"
    log.show(SYNC, UserWarning, OURS, 210)
    log.show(SYNC, UserWarning, VLLMS, 1328)
    log.show("some other warning", UserWarning, OURS, 99)
    log.kind = "mixed"
    log.show(SYNC, UserWarning, OURS, 210)
    log.show(SYNC, UserWarning, OURS, 210)
    report = log.report()
    assert report["syncs"] == {"first": {f"{OURS}:210": 1, f"{VLLMS}:1328": 1},
                               "mixed": {f"{OURS}:210": 2}}
    assert report["ours"] == {f"{OURS}:210": 3}  # vLLM's own, not called from ours: left out
    assert f"{OURS}:99" not in report["callers"]


def test_a_site_of_vllm_called_from_our_package_counts_as_ours():
    log = SyncLog()
    log.kind = "decode"
    log.show(SYNC, UserWarning, VLLMS, 7)
    log.callers[f"{VLLMS}:7"] = [f"{OURS}:12 _step"]  # as traceback would give it
    assert log.ours() == {f"{VLLMS}:7": 1}


def _frames(*places: str) -> list:
    from traceback import FrameSummary

    return [FrameSummary(path, int(line), name)
            for path, line, name in (p.split(":") for p in places)]


PROBE = "/site/vllm_specplug/testing/host_syncs.py"
TORCH = "/site/torch/cuda/__init__.py"


def test_the_probes_own_switch_is_counted_apart_and_its_frames_are_no_callers():
    """On the H100 the probe's `set_sync_debug_mode("warn")` reported a
    synchronize once a process, its innermost frame of ours the probe's
    line: that failed the GPU test for chain and tree alike
    (docs/results/v2_host_syncs_test_h100_s71)."""
    log = SyncLog()
    log.kind = "first"
    log.record(f"{TORCH}:1270", _frames(f"{VLLMS}:1328:execute_model", f"{PROBE}:104:step",
                                        f"{TORCH}:1270:set_sync_debug_mode"))
    # vLLM's own sync right under the probe's wrapper: vLLM's, not ours
    log.record(f"{TORCH}:99", _frames(f"{VLLMS}:1328:execute_model", f"{PROBE}:106:step",
                                      "/site/vllm/v1/worker/gpu/model_runner.py:50:execute_model",
                                      f"{TORCH}:99:synchronize"))
    # ours, deeper: still ours
    log.record(f"{OURS}:210", _frames(f"{VLLMS}:1328:execute_model", f"{PROBE}:106:step",
                                      f"{OURS}:210:ingest_slots"))
    report = log.report()
    assert report["probe"] == 1
    assert report["syncs"] == {"first": {f"{TORCH}:99": 1, f"{OURS}:210": 1}}
    assert report["ours"] == {f"{OURS}:210": 1}
    assert all(PROBE not in frame for frames in report["callers"].values() for frame in frames)
