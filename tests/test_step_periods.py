"""The step clock of a bench's timed repeats (`bench/step_periods.py`), on
stand-ins of the runner and its scheduler outputs: what
tests/test_bench.py's engine run reads back."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from vllm_specplug.bench.step_periods import StepPeriods, summarise, watch_step_periods


def _output(opens_wave: bool, num_tokens: int = 4):
    return SimpleNamespace(total_num_scheduled_tokens=num_tokens,
                           scheduled_cached_reqs=SimpleNamespace(
                               req_ids=[] if opens_wave else ["r0"]))


def test_periods_leave_out_the_idle_time_before_a_wave_and_count_slow_steps():
    clock = StepPeriods()
    # wave 1: steps at 0, 10, 20, 60 ms (the last one slow: 40 ms); idle; wave 2 at 1000
    for now_ms, opens in ((0, True), (10, False), (20, False), (60, False),
                          (1000, True), (1010, False)):
        clock.step(_output(opens), now_ms / 1e3)
    clock.step(_output(False, num_tokens=0), 2.0)  # no tokens: not a step
    summary = clock.take()
    # 10, 10, 40 (wave 1), then 10 (wave 2): the 940 ms before wave 2 left out
    assert summary["num_steps"] == 4 and abs(summary["max_ms"] - 40) < 1e-6
    assert abs(summary["median_ms"] - 10) < 1e-6 and abs(summary["total_ms"] - 70) < 1e-6
    assert summary["num_slow"] == 1 and abs(summary["slow_excess_ms"] - 30) < 1e-6
    assert clock.take() is None  # cleared


def test_summary_of_no_periods_is_none_and_percentiles_order():
    assert summarise(np.zeros(0)) is None
    summary = summarise(np.arange(1.0, 101.0))
    assert summary["median_ms"] <= summary["p90_ms"] <= summary["p99_ms"] <= summary["max_ms"]


def test_the_runner_is_wrapped_once_and_each_start_clears_the_record():
    calls = []
    runner = SimpleNamespace(execute_model=lambda output: calls.append(output) or "ran")
    clock = watch_step_periods(runner)
    assert runner.execute_model(_output(True)) == "ran" and len(calls) == 1
    runner.execute_model(_output(False))
    assert watch_step_periods(runner) is clock and clock.starts == []  # started again: cleared
    wrapped = runner.execute_model
    watch_step_periods(runner)
    assert runner.execute_model is wrapped  # not wrapped twice


def test_five_repeats_cells_stay_apart_under_their_heads():
    """The H100's five-repeat table glued a column's last value to the next
    column's first (docs/results/smollm2_chains_b64_h100_s72): every column
    starts where its head does, whatever the number of repeats."""
    from types import SimpleNamespace as Row

    from vllm_specplug.bench.report import format_step_periods_table
    from vllm_specplug.bench.step_periods import period_cells

    repeat = summarise(np.array([3.4, 3.5, 31.1, 3.6, 25.2]))
    cells = period_cells([repeat] * 5)
    assert re.split(r"\s{2,}", cells.strip())[1:] == [
        " ".join([format(repeat[key], fmt)] * 5)
        for key, fmt in (("median_ms", ".2f"), ("p99_ms", ".1f"), ("max_ms", ".1f"),
                         ("num_slow", "d"), ("slow_excess_ms", ".0f"))]
    table = format_step_periods_table([Row(name="ours", batch_size=64, error=None,
                                           step_periods=[repeat] * 3)])
    head, _, line = table.splitlines()[-3:]
    for title in ("median ms", "p99 ms", "max ms", "over 2x"):
        column = line[head.index(title):]
        assert column[0] != " " and line[head.index(title) - 1] == " ", title
