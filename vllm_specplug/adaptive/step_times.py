"""Measured decode-step times per (draft length, bucket of batch sizes), for
the batch policy (batch_draft_length.py).

A bucket spans a doubling of the batch (1, 2-3, 4-7, ...): a GPU's step time
is flat, then steep, in steps, with graph sizes, and a line through all batch
sizes misjudged one bucket by another (docs/results/batch_draft_length_h100).
Within a bucket the batch still moves up to 2x, and on a CPU a step's time
grows with its requests: on SmolLM2 (docs/results/batch_draft_length_cpu_run3)
the steps without drafts in the 16-31 bucket came from the batch-80 phase
draining through 31..16, those with 5 drafts from the batch-16 phase, and K=0
looked slower than K=5 where no speculation ran 1.3x faster. So every time is
read at one batch size: each sample is scaled by (b / b_i) ** exponent, the
bucket's exponent fitted on how its lengths' own times moved with the batch
(Theil-Sen: the median slope of log time over log batch among pairs of
samples of one length; robust to the slow steps that remain).
"""
from __future__ import annotations

import math
from collections import deque

from vllm_specplug.adaptive.step_fits import clipped_mean, theil_sen_exponent, weighted_line

# samples of a (length, bucket) before its typical time counts, and how many
# it keeps: at batch 1 on the H100 one step's time moved 20%, and the lower
# quartiles of two windows of 8 steps of the same cost were often 25% apart
MIN_SAMPLES = 3
WINDOW = 32
# A step this many times slower than a step known to do at least as much
# work (as many drafts or more, as many requests or more) stalled: a graph
# captured on first use at a new padded batch size or key range took
# 200-450 ms on the H100 where the same step replayed took 2-30 ms
# (docs/results/batch_draft_length_h100, diag_after.txt: 8@16 at 27 ms).
STALL_RATIO = 3.0
# A length's time is carried over from buckets at most this many doublings of
# the batch away. On the H100 every length took 3 ms at batch 1 (latency-
# bound) and 17-31 ms at 256: a ratio carried from batch 1 to 256 priced every
# length the same there, and the longest was kept without being measured
# (docs/results/batch_draft_length_h100_run2, diag_stall_guard.txt).
MAX_TRANSFER_BUCKETS = 2
# Pairs of samples whose batch sizes differ by less than this ratio say
# little about the slope (3-20% noise over a few percent of batch), and the
# fit needs this many pairs; its exponent is kept within [0, MAX_EXPONENT]
# (more requests never make a step faster; a step at most ~linear in them)
MIN_BATCH_RATIO = 1.2
MIN_PAIRS = 8
MAX_EXPONENT = 1.5
# the fit (and the spread) are taken again after this many new samples in
# their bucket (the fit weighs up to ~3000 pairs; the policy reads both
# every step)
REFIT_EVERY = 8
# A host's speed drifts: on the H200 one engine's repeats moved 1.5-2x beside
# the bench's other engines, and on the 2-core CPU no speculation's own
# repeats moved 1.5x. A length timed in a slow spell and rarely again (one the
# policy only tries now and then) kept that spell's time, and the policy
# compared it with the current length's fresh times: at batch 1 on CPU, K=0's
# three samples of 9.7 ms against 15 nodes' last 32 at 19.6, where their
# steps over the run averaged 31 ms (docs/results/batch_draft_length_cpu_run6).
# So samples are kept relative to the host's speed when taken (`host`): the
# current length's steps against their own typical time, an exponentially
# weighted mean with this weight per step, kept within HOST_RANGE. It
# follows a lasting change only in part (the current length's window takes in
# the rest while it moves: after a 2x speed-up it settled at 0.6, not 0.5),
# and a change in the current length's own cost is read as the host's too;
# at weight 0.1 it cost the simulated draining phases about 1% where the
# host did not drift (test_lengths_measured_at_other_batch_sizes_...).
HOST_WEIGHT = 0.1
HOST_RANGE = (0.25, 4.0)
# A length's time in a bucket is drawn towards the bucket's cost line
# (`line`: seconds = a + b * K, fitted on every drafting length's times there)
# as if the line were this many samples of its own. A length measured on a
# few steps kept whatever those few steps took: under the 2-core CPU's stalls
# (one step in five 1.5-4x slow) a few quiet steps priced K=5 at about half its
# cost at batch 80, and the policy ran it on 9% of the steps of bench
# offline's batch-80 phase (benchmarks/policy_noise.py, `cpu_phases`: 6% of
# the phase's time lost, 0.8% with the line). A length measured on its full
# window (32) keeps 80% of its own mean, so a cost that is not linear in K
# (a GPU's padded graph sizes) still shows.
LINE_WEIGHT = 8.0


def _drop(cache: dict, stale) -> None:
    """Forget the entries of `cache` whose key is `stale`."""
    for key in [key for key in cache if stale(key)]:
        del cache[key]


def batch_bucket(batch_size: int) -> int:
    """1 -> 1, 2-3 -> 2, 4-7 -> 3, ... (powers of two)."""
    return max(int(batch_size), 1).bit_length()


def bucket_batch(bucket: int) -> int:
    """The smallest batch size of `bucket`: where `step_ms` reads times."""
    return 2 ** (bucket - 1)


class StepTimes:
    """Seconds of recent decode steps per (length, batch bucket), each kept
    with its batch size."""

    def __init__(self) -> None:
        # (K, bucket) -> (batch size, seconds) of its last `WINDOW` steps
        self.samples: dict[tuple[int, int], deque] = {}
        # bucket -> `spread` / fitted exponent (None: too few pairs), until
        # the bucket's next refit (`REFIT_EVERY` samples; the spread also
        # when a length reaches `MIN_SAMPLES` there)
        self.spreads: dict[int, float] = {}
        self.fits: dict[int, float | None] = {}
        self.fit_age: dict[int, int] = {}  # bucket -> samples added since its fit
        # what the policy asks every step, until it can change: bucket ->
        # `exponent`, and bucket -> {(K, batch size): `typical`}
        self.exponents: dict[int, float] = {}
        self.typicals: dict[int, dict[tuple[int, int], float | None]] = {}
        self.medians: dict[tuple[int, int], float] = {}  # (K, bucket) -> raw median
        # (fixed, per verified token) seconds that override the samples (tests)
        self.pinned: tuple[float, float] | None = None
        # the host's speed now against the samples kept (kept as seconds / host)
        self.host = 1.0
        self.max_bucket = 0  # the biggest bucket with samples (`ceiling`)
        self.ceilings: dict[tuple[int, int], tuple[float, int] | None] = {}
        # (K, batch size) -> `_capped`, asked for every length every step:
        # kept until that length's times, its bucket's line or every
        # length's spread moves
        self.capped: dict[tuple[int, int], tuple[float, float] | None] = {}
        self.lines: dict[int, tuple[float, float] | None] = {}  # batch size -> `line`

    def add(self, k: int, batch_size: int, seconds: float, follow_host: bool = False) -> bool:
        """Keep a step's time, relative to the host's speed (`host`, which a
        step of the length the policy runs moves: `follow_host`); False (not
        kept) when it stalled: it took more than `STALL_RATIO` times the
        typical step that does at least as much work (`reference`)."""
        key = (k, batch_bucket(batch_size))
        reference = self.reference(*key)
        if reference is not None and seconds / self.host > STALL_RATIO * reference:
            return False
        if follow_host:
            self._follow_host(key, batch_size, seconds)
        self.samples.setdefault(key, deque(maxlen=WINDOW)).append(
            (int(batch_size), seconds / self.host))
        self.max_bucket = max(self.max_bucket, key[1])
        _drop(self.ceilings, lambda c: c[0] == k and c[1] < key[1])  # they read k's time here
        self.fit_age[key[1]] = self.fit_age.get(key[1], 0) + 1
        if self.fit_age[key[1]] >= REFIT_EVERY or key[1] not in self.fits:
            self._refit(key[1])
        # only this length's typical times moved (a refit clears them all)
        _drop(self.typicals.get(key[1], {}), lambda c: c[0] == k)
        self.medians.pop(key, None)
        # k's times here moved, and with them its bucket's line (`line`)
        _drop(self.capped, lambda c: c[0] == k or batch_bucket(c[1]) == key[1])
        _drop(self.lines, lambda b: batch_bucket(b) == key[1])
        if len(self.samples[key]) <= MIN_SAMPLES:  # a length joins the pooled spread
            self.spreads.pop(key[1], None)
            self.capped.clear()  # every length's noise in the bucket moved
        return True

    def _follow_host(self, key: tuple[int, int], batch_size: int, seconds: float) -> None:
        """Move `host` towards this step's time over its length's typical
        one (at its batch size): where the host slowed down, every length's
        time is read that much higher, whenever it was taken."""
        typical = self.typical(key[0], key[1], batch_size)
        if typical is None:
            return
        speed = (1 - HOST_WEIGHT) * self.host + HOST_WEIGHT * seconds / typical
        self.host = min(max(speed, HOST_RANGE[0]), HOST_RANGE[1])

    def _refit(self, bucket: int) -> None:
        """Take the bucket's exponent and spread again (every `REFIT_EVERY`
        samples: each weighs every sample of the bucket, and one more sample
        moves neither much). The times scaled by the exponent are taken
        again only if it moved (a bucket of one batch size has none)."""
        fit = theil_sen_exponent(self.samples, bucket, MIN_BATCH_RATIO, MIN_PAIRS, MAX_EXPONENT)
        if bucket not in self.fits or fit != self.fits[bucket]:
            self.exponents.clear()
            self.typicals.clear()
            self.ceilings.clear()
            self.lines.clear()
        self.fits[bucket], self.fit_age[bucket] = fit, 0
        self.capped.clear()
        self.spreads.pop(bucket, None)

    def reference(self, k: int, bucket: int) -> float | None:
        """The lowest median time at `k` in `bucket`, or with as many drafts
        or more in a bucket as big or bigger: such a step does at least as
        much work, so one here should not take much longer. Medians of
        `MIN_SAMPLES` or more, so that one step that returned early (outputs
        queued behind a host stall) does not reject the rest."""
        times = [self._median(key) for key, window in self.samples.items()
                 if key[0] >= k and key[1] >= bucket and len(window) >= MIN_SAMPLES]
        return min(times, default=None)

    def _median(self, key: tuple[int, int]) -> float:
        if key not in self.medians:
            self.medians[key] = sorted(s for _, s in self.samples[key])[len(self.samples[key]) // 2]
        return self.medians[key]

    def scaled(self, k: int, bucket: int, batch_size: int) -> list[float]:
        """(k, bucket)'s step times as if each step had had `batch_size`
        requests, sorted."""
        exponent, window = self.exponent(bucket), self.samples.get((k, bucket), ())
        if exponent == 0.0 or bucket == 1:  # bucket 1 holds batch 1 only
            return sorted(s for _, s in window)
        return sorted(s * (batch_size / b) ** exponent for b, s in window)

    def typical(self, k: int, bucket: int, batch_size: int | None = None) -> float | None:
        """The mean of the bucket's last `WINDOW` step times at `batch_size`
        (the bucket's smallest by default; None under `MIN_SAMPLES`), less
        those `STALL_RATIO` times over or under their median (a graph
        captured on first use, a stall; an interval that ended early), in the
        host's speed when each was taken (`host`). The mean, because tokens
        per second is tokens over the steps' summed time: where a step's work varies (n-gram and
        suffix draft for some requests only), a quantile misprices it. On
        SmolLM2 on CPU, suffix's steps at K=5 and batch 16 had a lower
        quartile of 90 ms and a mean of 138: read by the quartile, K=5 beat
        no speculation (84 ms), which ran 1.1x faster than it
        (docs/results/batch_draft_length_cpu_run4)."""
        key = (k, batch_size or bucket_batch(bucket))
        cache = self.typicals.setdefault(bucket, {})
        if key not in cache:
            times = self.scaled(k, bucket, key[1])
            cache[key] = clipped_mean(times, STALL_RATIO) if len(times) >= MIN_SAMPLES else None
        return cache[key]

    def exponent(self, bucket: int) -> float:
        """How a step's time grows with the batch in `bucket` (time ~ b **
        exponent): the bucket's own fit, else the nearest bucket's within
        `MAX_TRANSFER_BUCKETS`, else 0 (every sample taken as it is)."""
        if bucket not in self.exponents:
            fits = [self.fits.get(bucket - d) if self.fits.get(bucket - d) is not None
                    else self.fits.get(bucket + d) for d in range(MAX_TRANSFER_BUCKETS + 1)]
            self.exponents[bucket] = next((f for f in fits if f is not None), 0.0)
        return self.exponents[bucket]

    def noise(self, k: int, bucket: int) -> float:
        """The relative standard error of `typical(k, bucket)`: the bucket's
        spread (`spread`) over sqrt(k's samples there). On the H100 at batch
        1 steps of every length took 3-4 ms, each moving about 20%
        (docs/results/batch_draft_length_h100_run2, diag_stall_guard.txt):
        differences that size between two lengths' times are noise, not cost."""
        window = self.samples.get((k, bucket))
        if window is None or len(window) < MIN_SAMPLES:
            return 0.0
        return self.spread(bucket) / math.sqrt(len(window))

    def spread(self, bucket: int) -> float:
        """The interquartile range of the bucket's step times (at one batch
        size), each relative to its length's median, pooled over lengths: how
        much one step's time moves at this batch size. Pooled because a few
        samples of one length put their quartiles close together by chance
        as often as not. Taken again with the bucket's exponent (`_refit`)
        or when a length reaches `MIN_SAMPLES` there."""
        if bucket not in self.spreads:
            self.spreads[bucket] = self._pooled_spread(bucket)
        return self.spreads[bucket]

    def _pooled_spread(self, bucket: int) -> float:
        relative = []
        for (k, b), window in self.samples.items():
            if b == bucket and len(window) >= MIN_SAMPLES:
                times = self.scaled(k, b, bucket_batch(b))
                middle = times[len(times) // 2]
                relative.extend(t / max(middle, 1e-12) for t in times)
        if len(relative) < 2 * MIN_SAMPLES:
            return 0.0
        relative.sort()
        return relative[(3 * len(relative)) // 4] - relative[len(relative) // 4]

    def _capped(self, k: int, bucket: int, batch_size: int) -> tuple[float, float] | None:
        """(seconds, relative standard error) of `k` at `batch_size` in
        its bucket: its typical time, or a bigger bucket's lower one
        (`ceiling`); None while it has too few samples here."""
        if (k, batch_size) not in self.capped:
            own, ceiling = self._on_line(k, bucket, batch_size), self.ceiling(k, bucket)
            self.capped[(k, batch_size)] = (
                None if own is None else ceiling if ceiling is not None and ceiling[0] < own
                else (own, self.noise(k, bucket)))
        return self.capped[(k, batch_size)]

    def _on_line(self, k: int, bucket: int, batch_size: int) -> float | None:
        """`typical(k, bucket, batch_size)` drawn towards the bucket's
        cost line with `LINE_WEIGHT` samples' weight; no speculation
        (k = 0) keeps its own: a step without drafts skips the drafting
        pass, which the line's intercept holds."""
        own = self.typical(k, bucket, batch_size)
        line = self.line(batch_size) if own is not None and k > 0 else None
        if line is None:
            return own
        num_samples = len(self.samples[(k, bucket)])
        return ((num_samples * own + LINE_WEIGHT * (line[0] + line[1] * k))
                / (num_samples + LINE_WEIGHT))

    def line(self, batch_size: int) -> tuple[float, float] | None:
        """(intercept, seconds per draft) of the drafting lengths' times at
        `batch_size` in its bucket: a least-squares line through each
        length's `typical` time, weighted by its samples, the slope kept
        >= 0 (a longer draft never costs less); None under two lengths
        measured there. Every step at any length moves it, where a length's
        own mean moves only with its own (rare) steps."""
        if batch_size not in self.lines:
            bucket, points = batch_bucket(batch_size), []
            for (k, b), window in self.samples.items():
                time = self.typical(k, b, batch_size) if b == bucket and k > 0 else None
                if time is not None:
                    points.append((k, time, len(window)))
            self.lines[batch_size] = weighted_line(points)
        return self.lines[batch_size]

    def ceiling(self, k: int, bucket: int) -> tuple[float, float] | None:
        """(seconds, relative standard error) of `k`'s lowest typical time in
        a bigger bucket, read at that bucket's smallest batch size (more
        requests than any step of `bucket`); None if none has one. More
        requests never make a step faster, so a time in `bucket` above it
        was taken in a slow spell and not taken again since: on the H200 the
        adaptive tree's first steps (batch 1, 15 and 8 nodes) ran 14 ms, 15
        nodes later 4.7 ms at batch 2-3, and read as taken, batch 1 ran 4
        nodes on 98% of its steps (docs/results/batch_draft_length_h200_run9).
        The host's speed (`host`) does not mend that: it follows the length
        the policy runs, and the slow spell had passed before its times."""
        if (k, bucket) not in self.ceilings:  # (seconds, its bucket), kept until k's
            best = None  # times above `bucket` move (`add`) or every time does (`_refit`)
            for above in range(bucket + 1, self.max_bucket + 1):
                if (k, above) in self.samples:
                    time = self.typical(k, above)
                    if time is not None and (best is None or time < best[0]):
                        best = (time, above)
            self.ceilings[(k, bucket)] = best
        best = self.ceilings[(k, bucket)]
        return None if best is None else (best[0], self.noise(k, best[1]))

    def windows(self) -> dict[str, dict]:
        """"K@batch" (as `step_ms`) -> the raw window: its samples, mean
        batch size, and mean, median and lower quartile in ms (the policy
        reads the mean, `typical`; under async scheduling an interval between
        two outputs may also stray low, outputs queued behind a host stall,
        docs/results/batch_draft_length_h200_run5)."""
        out = {}
        for (k, b), window in sorted(self.samples.items()):
            seconds = sorted(s for _, s in window)
            out[f"{k}@{bucket_batch(b)}"] = {
                "n": len(seconds), "batch": round(sum(n for n, _ in window) / len(window), 1),
                "mean": round(1e3 * sum(seconds) / len(seconds), 3),
                "median": round(1e3 * seconds[len(seconds) // 2], 3),
                "q1": round(1e3 * seconds[len(seconds) // 4], 3)}
        return out

    def estimate(self, k: int, batch_size: int, anchor: int) -> tuple[float, float] | None:
        """(seconds, relative standard error) of a step at `k` with
        `batch_size` requests: measured in its bucket (or a bigger bucket's
        lower time, `ceiling`), or the `anchor`
        length's time there times their ratio in the nearest bucket where
        both were measured, `MAX_TRANSFER_BUCKETS` at most away (the three
        errors combined); None otherwise (the policy then measures it).
        No speculation (k = 0) is never carried over: its ratio to a
        speculative length moves most with the batch (SmolLM2 on CPU: K=5
        1.23x its time at batch 8, 1.64x at 16), and a carried time kept
        the policy from ever timing it where it was the best length
        (docs/results/suffix_drift_cpu)."""
        if self.pinned is not None:
            return self.pinned[0] + self.pinned[1] * batch_size * (k + 1), 0.0
        bucket = batch_bucket(batch_size)
        own = self._capped(k, bucket, batch_size)
        if own is not None or k == anchor or k == 0:
            return None if own is None else (own[0] * self.host, own[1])
        base = self._capped(anchor, bucket, batch_size)
        if base is None:
            return None
        base = base[0]
        buckets = sorted({b for (length, b) in self.samples
                          if length == k and abs(b - bucket) <= MAX_TRANSFER_BUCKETS},
                         key=lambda b: abs(b - bucket))
        for other in buckets:
            mine, theirs = self.typical(k, other), self.typical(anchor, other)
            if mine is not None and theirs is not None:
                error = math.hypot(self.noise(anchor, bucket), self.noise(k, other),
                                   self.noise(anchor, other))
                return base * self.host * mine / theirs, error
        return None
