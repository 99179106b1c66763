"""The batch policy's priced steps (adaptive/batch_draft_stats.py): per
length, the decode steps it had a price for, as taken against as expected,
summed by `bench offline` over repeats and shown in its table. On SmolLM2 on
CPU the policy's normalised windows put K=5 at 81 ms a step at batch 16,
where static K=5 ran at 0.85x of no speculation for 1.74 tokens a step
(docs/results/batch_draft_length_cpu_run14): what a step took and what the
policy expected of it, side by side, say whether its prices were wrong
(run 15 there: K=5's within 6%, K=0's a third low)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength
from vllm_specplug.adaptive.step_times import MIN_SAMPLES


def test_a_step_is_priced_only_once_its_length_has_a_time_and_keeps_both():
    policy = BatchDraftLength((0, 4))
    for _ in range(MIN_SAMPLES):  # no price yet: a length's first samples
        policy.measured(0, 16, 0.010)
        policy.measured(4, 16, 0.020)
    assert policy.stats.priced_steps == {}
    policy.measured(4, 16, 0.030)  # priced at its samples' 20 ms, took 30
    policy.measured(0, 16, 0.012)
    stats = policy.stats
    assert stats.priced_steps == {4: 1, 0: 1}
    assert stats.priced_seconds[4] == pytest.approx(0.030)
    assert stats.expected_seconds[4] == pytest.approx(0.020)
    # K=0 read at the host's speed, which the current length's slow step moved
    # a tenth of the way to 1.5x (StepTimes.HOST_WEIGHT)
    assert stats.expected_seconds[0] == pytest.approx(0.010 * 1.05)
    counters = policy.counters()
    assert counters["priced_steps"] == {4: 1, 0: 1}
    assert counters["expected_seconds"][4] == pytest.approx(stats.expected_seconds[4])


def test_bench_sums_priced_steps_over_repeats_and_shows_taken_against_expected():
    from vllm_specplug.bench.offline import batch_policy_delta
    from vllm_specplug.bench.report import format_batch_policy_table

    def counters(steps, priced, taken, expected):
        return {"current": 4, "num_steps": steps, "num_explored": 0, "num_measured": steps,
                "num_stalled": 0, "num_first_at_shape": 0, "chosen": {0: 0, 4: steps},
                "expected_tokens": 2.0 * steps, "realised_tokens": 2.0 * steps,
                "num_requests": steps, "priced_steps": priced, "priced_seconds": taken,
                "expected_seconds": expected}

    start = counters(10, {"4": 5}, {"4": 0.5}, {"4": 0.4})
    end = counters(30, {"0": 2, "4": 15}, {"0": 0.2, "4": 1.5}, {"0": 0.18, "4": 1.2})
    # the policy's state beside its counts: as of the last read, not differenced
    windows = {"4@16": {"n": 32, "mean": 80.0}}
    start["step_windows"], end["step_windows"] = {"4@16": {"n": 3, "mean": 90.0}}, windows
    first = batch_policy_delta(None, start, end)
    assert first["step_windows"] == windows
    assert first["priced_steps"] == {"0": 2, "4": 10}
    assert first["priced_seconds"]["4"] == pytest.approx(1.0)
    total = batch_policy_delta(first, end, counters(40, {"0": 2, "4": 25}, {"0": 0.2, "4": 2.5},
                                                    {"0": 0.18, "4": 2.0}))
    assert total["priced_steps"] == {"0": 2, "4": 20}
    row = SimpleNamespace(name="suffix-batch", batch_size=16, error=None, batch_policy=total)
    table = format_batch_policy_table([row])
    # 0: 200 ms over 2 steps, 180 expected; 4: 2.0 s over 20, 1.6 expected
    assert "| 0:100/90 4:100/80" in table, table
    new_keys = ("priced_steps", "priced_seconds", "expected_seconds")
    old = {key: value for key, value in total.items() if key not in new_keys}  # from before
    line = format_batch_policy_table([SimpleNamespace(
        name="suffix-batch", batch_size=16, error=None, batch_policy=old)]).splitlines()[-1]
    assert line.endswith("4:100%"), line
