"""`benchmarks/policy_replay.py`: a batch policy's trace replayed through its
step times gives the trace's own prices and host speeds, and says when a
changed constant moves them (issue 27; docs/results/batch_draft_length_cpu_run20)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from vllm_specplug.testing.policy_sim import ChainEngine, run_steps, stalling_suffix
from vllm_specplug.adaptive import step_times
from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import policy_replay  # noqa: E402


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """The trace of a policy on the stalling engine (this CPU's), 600 steps
    at batch 16, written as the logging config writes it; and the policy."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(f"2026-12-05 00:00:00,000 1 {record.getMessage()}")

    logger = logging.getLogger("vllm_specplug.policy_trace")
    handler, level = Keep(level=logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        policy = BatchDraftLength(draft_length_candidates(5))
        run_steps(ChainEngine(**stalling_suffix(16), seed=2), 16, 600, policy)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    path = tmp_path_factory.mktemp("trace") / "policy_trace.log"
    path.write_text("engine start-up line\n" + "\n".join(records) + "\n")
    return path, policy


def test_a_replay_gives_the_traces_own_prices_and_host_speeds(trace, tmp_path, capsys):
    path, policy = trace
    summary = policy_replay.main([str(path), "--json", str(tmp_path / "replay.json")])
    assert summary["faithful"] and summary["steps"] == policy.num_decode_steps
    assert "replay faithful to the trace: yes" in capsys.readouterr().out
    # the host's speed moved (the stalls), and ends where the policy's did
    # before its last step
    assert len(set(summary["host_path"])) > 3
    assert summary["ran"]["steps"] > 100 and summary["tried"]
    # each try's price against the current length's, read against its time
    # over the current length's steps beside it: one entry per tried length
    relative = summary["tried_relative"]
    assert relative and all(v["steps"] > 0 and v["median"] > 0 for v in relative.values())
    assert set(relative) <= set(summary["tried"])
    assert (tmp_path / "replay.json").stat().st_size > 0


def test_a_try_is_read_against_one_step_of_the_current_length_not_its_mean():
    """A try is one step; the current length's steps beside it include the
    CPU's stalls. Against their mean, a try that cost the same as them read
    dear; against their median it reads as it is."""
    from policy_replay import TraceStep, _beside

    steps = [TraceStep(5, 1, ms, 50.0, 1.0, 5) for ms in [50.0] * 10 + [150.0] * 3]
    steps.append(TraceStep(4, 1, 50.0, 50.0, 1.0, 5))  # the try, as dear as a quiet step
    steps += [TraceStep(5, 1, 90.0, 50.0, 1.0, 16)]  # another length's steps: not beside it
    assert _beside(steps, 13) == 50.0


def test_a_changed_constant_is_replayed_and_said_unfaithful(trace):
    path, _ = trace
    summary = policy_replay.main([str(path), "--set", "HOST_WEIGHT=0.0"])
    assert not summary["faithful"] and set(summary["host_path"]) == {1.0}
    assert step_times.HOST_WEIGHT > 0.0  # the code's again for whatever runs next
    with pytest.raises(SystemExit, match="no constant 'HOST_WIEGHT'"):
        policy_replay.main([str(path), "--set", "HOST_WIEGHT=0.0"])


def test_a_file_without_a_trace_says_how_to_record_one(tmp_path):
    empty = tmp_path / "engine.log"
    empty.write_text("INFO vLLM started\n")
    with pytest.raises(ValueError, match="benchmarks/logging/policy_trace.json"):
        policy_replay.main([str(empty)])
