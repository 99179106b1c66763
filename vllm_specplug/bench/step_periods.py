"""Every step's period in a bench's timed repeats, from one `execute_model`
call to the next, and the slow ones.

On the H100 (SmolLM2, MT-Bench, batch 64) our chain's waves decoded 1.33x
longer than vLLM's `eagle3` K=5's over the timed repeats, its repeats
852-1432 ms against 779-936, while the phases pass, one probed wave after
the repeats, had its decode step under vLLM's (4.01 against 4.15 ms;
docs/results/smollm2_bestk_fix_h100_s71). One probed wave does not show
steps that are slow now and then. This clock runs during the timed
repeats themselves, at the cost of a timestamp a step: each repeat's
periods as a distribution (median, p90, p99, max) and its slow steps,
those over `SLOW` times the median, with the time they took beyond it.

A period is the interval from a step's `execute_model` call to the next
one's (under async scheduling the host is held back by the GPU once the
pipeline is full, so these add up to the wall time). The interval before a
step that opens a wave (every request new to the runner) is left out: it
holds the idle time between two `generate` calls; so is a repeat's last.
"""
from __future__ import annotations

import functools
import time

import numpy as np

from vllm_specplug.bench.step_kinds import opens_wave

SLOW = 2.0  # a step over twice its repeat's median period is slow
MAX_STEPS = 1 << 20  # a repeat's steps recorded at most (8 MiB of stamps)


class StepPeriods:
    """The start of each step since the last `take` (perf_counter seconds),
    and whether it opened a wave."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.opens_wave: list[bool] = []

    def step(self, scheduler_output, now: float) -> None:
        """A step starts at `now`; one that schedules no tokens is none."""
        if not getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            return
        if len(self.starts) < MAX_STEPS:
            self.starts.append(now)
            self.opens_wave.append(opens_wave(scheduler_output))

    def take(self) -> dict | None:
        """This repeat's periods summarised (ms) and the record cleared;
        None with fewer than two steps."""
        starts, opens = np.asarray(self.starts), np.asarray(self.opens_wave, dtype=bool)
        self.starts, self.opens_wave = [], []
        periods = 1e3 * np.diff(starts)[~opens[1:]] if len(starts) > 1 else np.zeros(0)
        return summarise(periods)


def summarise(periods_ms: np.ndarray) -> dict | None:
    """{"num_steps", "median_ms", "p90_ms", "p99_ms", "max_ms", "total_ms",
    "num_slow", "slow_excess_ms"} of a repeat's periods (ms); None if none."""
    if not len(periods_ms):
        return None
    median = float(np.median(periods_ms))
    slow = periods_ms[periods_ms > SLOW * median]
    p90, p99 = np.percentile(periods_ms, [90, 99])
    return {"num_steps": int(len(periods_ms)), "median_ms": median, "p90_ms": float(p90),
            "p99_ms": float(p99), "max_ms": float(periods_ms.max()),
            "total_ms": float(periods_ms.sum()), "num_slow": int(len(slow)),
            "slow_excess_ms": float((slow - median).sum())}


def watch_step_periods(runner) -> StepPeriods:
    """The runner's clock, its `execute_model` wrapped on the instance the
    first time (a bench's phases probe wraps it again and restores this);
    cleared on every call."""
    clock = getattr(runner, "_specplug_step_periods", None)
    if clock is not None:
        clock.take()
        return clock
    clock = runner._specplug_step_periods = StepPeriods()
    execute_model = runner.execute_model

    @functools.wraps(execute_model)
    def timed(*args, **kwargs):
        clock.step(args[0] if args else kwargs.get("scheduler_output"), time.perf_counter())
        return execute_model(*args, **kwargs)

    runner.execute_model = timed
    return clock


PERIOD_WIDTHS = (15, 15, 18, 12)  # median, p99, max, slow steps


def period_cells(repeats: list[dict | None]) -> str:
    """Per repeat (joined by spaces): median / p99 / max ms a step, and the
    slow steps with the ms they took beyond the median. Columns are two
    spaces apart whatever the number of repeats (`PERIOD_WIDTHS` at least)."""
    found = [r for r in repeats if r]

    def joined(key: str, fmt: str) -> str:
        return " ".join(format(r[key], fmt) for r in found)
    cells = [joined("median_ms", ".2f"), joined("p99_ms", ".1f"), joined("max_ms", ".1f"),
             joined("num_slow", "d")]
    padded = "  ".join(c.ljust(w) for c, w in zip(cells, PERIOD_WIDTHS))
    return (f"{sum(r['num_steps'] for r in found):>8}  {padded}  "
            f"{joined('slow_excess_ms', '.0f')}")
