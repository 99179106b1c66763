"""The fits StepTimes (step_times.py) takes over its samples: a clipped
mean, a weighted cost line in K, and how a bucket's step time grows with
its batch (Theil-Sen). Pure functions; their thresholds are step_times.py's
constants, passed in so that a run can change them there
(`benchmarks/policy_noise.py --set`)."""
from __future__ import annotations

import math

import numpy as np


def clipped_mean(times: list[float], stall_ratio: float) -> float:
    """The mean of sorted `times` without those over `stall_ratio` x their
    median or under 1 / `stall_ratio` of it (an interval that ended early:
    outputs queued behind a host stall come back close together)."""
    middle = times[len(times) // 2]
    kept = [t for t in times if middle / stall_ratio <= t <= middle * stall_ratio]
    return sum(kept) / len(kept)


def weighted_line(points: list[tuple[int, float, int]]) -> tuple[float, float] | None:
    """(intercept, slope >= 0) of the least-squares line through (x, y)
    with weights w, `points` [(x, y, w)]; None under two distinct x. One
    pass over the sums (the policy asks for it on most measured steps)."""
    total = sum_x = sum_y = sum_xx = sum_xy = 0.0
    for x, y, w in points:
        total += w
        sum_x += w * x
        sum_y += w * y
        sum_xx += w * x * x
        sum_xy += w * x * y
    spread = total * sum_xx - sum_x * sum_x
    if len({x for x, _, _ in points}) < 2 or spread <= 0:
        return None
    slope = max((total * sum_xy - sum_x * sum_y) / spread, 0.0)
    return (sum_y - slope * sum_x) / total, slope


def theil_sen_exponent(samples: dict, bucket: int, min_batch_ratio: float,
                       min_pairs: int, max_exponent: float) -> float | None:
    """The median of d log(time) / d log(batch) over pairs of one length's
    samples in `bucket` (`samples`: (K, bucket) -> [(batch size, seconds)])
    whose batches differ by `min_batch_ratio` or more, kept within
    [0, `max_exponent`]; None under `min_pairs` such pairs."""
    slopes = []
    for (_, b), window in samples.items():
        # a window of one batch size has no pair (bucket 1 holds batch 1
        # only; a full batch stays at one size): the fit cost 0.5 ms a
        # refit on CPU, every `REFIT_EVERY` steps, for nothing
        if b != bucket or len(window) < 2 or not _batches_apart(window, min_batch_ratio):
            continue
        x, y = np.log(np.array(window, dtype=np.float64).clip(1e-12)).T
        dx, dy = np.subtract.outer(x, x), np.subtract.outer(y, y)
        apart = np.triu(np.abs(dx) >= math.log(min_batch_ratio), 1)
        slopes.append(dy[apart] / dx[apart])
    slopes = np.concatenate(slopes) if slopes else np.empty(0)
    if len(slopes) < min_pairs:
        return None
    return float(np.clip(np.median(slopes), 0.0, max_exponent))


def _batches_apart(window, min_batch_ratio: float) -> bool:
    """Whether two of the window's batch sizes differ by `min_batch_ratio`."""
    sizes = [b for b, _ in window]
    return max(sizes) >= min_batch_ratio * min(sizes)
