"""One draft length for the whole batch, chosen each step from measured step
costs and live acceptance (Model Runner V2 under async scheduling).

Under vLLM's `AsyncScheduler` every running request gets the same number of
speculative slots, so a per-request cut (controller.py) saves nothing there:
the cut slots are padded and verified all the same. What can change from one
step to the next is that number, K, for the whole batch: vLLM's dynamic
speculative decoding (`num_speculative_tokens_per_batch_size`) looks it up
per step in a static table of batch sizes, and Model Runner V2 captures a
FULL CUDA graph per K of the table. `BatchDraftLength` stands in for that
table: asked for batch size b, it returns the K among its candidates
(0 included: no speculation) with the most expected tokens per second,

    tokens/s(K) = b * E[tokens per request | K] / seconds(b, K),

where E comes from the accepted counts of recent steps verified at that K
(a request gains 1 + accepted tokens; for chains and trees alike the mean
can only grow with K, so it is kept non-decreasing; a length whose mean
falls below a shorter one's learnt on later requests is stale and tried
first, length_acceptance.py), and seconds(b, K) is
the mean of recent decode steps' times at that K in b's bucket
of batch sizes (powers of two: 1, 2-3, 4-7, ...), each scaled to b by how
the bucket's times grow with the batch (step_times.py). One-off
slow steps are kept out three ways: the scheduler does not time the first
step at each new shape (it captures a drafting graph: 200-450 ms on the
H100 where others took 4); a step `STALL_RATIO` times slower than one known
to do at least as much work is dropped; and the mean of the last 32 leaves
out those over 3x their median. A length not measured in this bucket is priced by its ratio to the
current length in the nearest bucket where both were measured, if that is
at most 4x the batch away (else it is measured there). A step
counts for the time of K only when it both verified the drafts asked at K
and drafted K for the next (the drafting of step t is paid in step t, its
verification in step t + 1), when the step before did too (settled: on the
H200 the first step that verified and drafted a new length ran 0.8-1.3 ms
over the steady step, so a length timed only right after a change looked
dearer than the one it left, and the policy kept whichever it ran;
docs/results/batch_draft_length_h200_run7), and only when it was a pure
decode step, whichever requests found a draft (n-gram and suffix often find
none: such a request counts as accepting nothing at K).

Each length is measured `MIN_SAMPLES` times at the first batch sizes seen
(and at others, where no ratio prices it). After that, one step in
`explore_every` tries another length, `HOLD_STEPS` in a row so that the last
one counts (settled): mostly a neighbour of the current one (cheap to try, and where the
best length moves as the batch grows and shrinks), at times the length
measured least recently, and only if what its steps are expected to
lose fits a credit of `EXPLORE_SHARE` of the time (a length far dearer than
the current one is tried rarely). A change needs a `switch_margin` gain over the
current K plus the noise of the two times (their standard errors): two
lengths that are about as good do not alternate, and a latency-bound batch,
where every length costs about the same, keeps the longest.

Related: vLLM's adaptive verification (DSpark, per-slot budgets from draft
confidences); SpecDec++ (Huang et al., 2024) and DISCO (Mamou et al., 2024)
choose K per step from acceptance alone, without the step's cost.
"""
from __future__ import annotations

import math
import time

from vllm_specplug.adaptive.batch_draft_stats import (MIN_KIND_STEPS, STEP_KINDS,
                                                       STEP_MS_EVERY, BatchDraftStats,
                                                       LengthStats)
from vllm_specplug.adaptive.length_acceptance import LengthAcceptance
from vllm_specplug.adaptive.step_times import (MIN_SAMPLES, StepTimes, batch_bucket,
                                                bucket_batch)

# an exploration holds its length this many steps: the first changes length
# (verifies the old drafts), the second is the first at the new length (slow
# on the H200), the third is timed (settled)
HOLD_STEPS = 3
# one exploration in this many measures the length measured least recently
# (the others try the current length's neighbours)
FAR_EVERY = 4
# Explorations may lose this share of the time, and save up at most
# MAX_EXPLORE_CREDIT steps' worth (at the current batch size): a try of a
# length 3x dearer per token waits about 400 steps, of one as good as the
# current one only `explore_every`
EXPLORE_SHARE = 0.01
MAX_EXPLORE_CREDIT = 8.0
# Where a tree's accepted paths teach every shorter size its acceptance
# (`verified_within`), a try of a shorter size only refreshes its time: one
# exploring turn in this many still tries them. On the H200 (batch 1, the
# tiny model) the adaptive tree ran 15 nodes 85-91% of its steps and tried
# others on 9% of its steps, each try three steps at a size that gains fewer
# tokens and two changes of length (docs/results/batch_draft_length_h200_run8)
TIME_ONLY_EVERY = 4
# the accepted paths teach the shorter sizes while they came this few steps
# ago (Model Runner V2 records one tree step's paths in 4, read a step or two
# later: integration/v2/path_ranks.py)
PATHS_RECENT_STEPS = 12
# It weighs its lengths on one step in this many (and on every step while a
# length is still being measured in its bucket); the others keep the length.
# A weighing prices every length, most of its host time (50-110 us on this
# CPU), where a step of a small model on the H200 takes 3-6 ms, host-bound
# under async scheduling (docs/results/batch_draft_length_h200_run10)
DECIDE_EVERY = 4
# ... and on a step whose batch moved more than this share from the last one
# it weighed at (a batch that drains or fills moves to other lengths)
REWEIGH_BATCH_SHARE = 0.25
# Once its weighings kept one length for `SETTLE_STEPS` steps, every length
# measured where the batch is, the policy is settled: the scheduler reads a
# step's acceptance and time, and a tree head records its paths,
# `SETTLED_FACTOR` times less often (`sample_every`; a try's steps are read
# whole), until a weighing moves it or a length is being measured. It still
# weighs on one step in `DECIDE_EVERY` and when the batch moves. On the H200
# (tiny model, batch 1, host-bound) the adaptive tree ran 15 nodes on all its
# steps, 0.32 ms a step over the static tree's 2.77: the policy's 151 us a
# step and the paths' recording (docs/results/batch_draft_length_h200_run12)
SETTLE_STEPS = 64
SETTLED_FACTOR = 8
# A move to a shorter length needs a gain beyond the margin of this many
# standard errors of the two times: the policy weighs its lengths every few
# steps, and one noisy time in twenty would otherwise move it (a longer
# length is never worse by the tokens it adds, so its risk is only its time).
# On the simulated engine under this CPU's stalls 0 did better (0.958 /
# 0.954 of the best static length at batch 16 / 80 against 0.948 / 0.940,
# benchmarks/policy_noise.py), but on the engine (SmolLM2, suffix) it ran
# 0.78 / 0.89 / 0.85x the better of none and static K=5 at batch 1 / 16 / 80
# against 2's 0.96 / 0.92 / 0.97: at batch 1 a shorter length priced from
# its first few steps (K=1: 34 ms expected, 73 taken) took 20% of the steps
# (docs/results/batch_draft_length_cpu_run20).
SWITCH_Z = 2.0


def draft_length_candidates(max_k: int) -> tuple[int, ...]:
    """0, 1, 2, 4, 8, ... below `max_k`, and `max_k`: few lengths (each is a
    FULL-graph family to capture and a choice to keep measured), spaced so
    that the gain of one more doubling is visible."""
    lengths = {0, max_k}
    power = 1
    while power < max_k:
        lengths.add(power)
        power *= 2
    return tuple(sorted(lengths))


class BatchDraftLength:
    """`lookup[batch_size] -> K`, as vLLM's dense dynamic-SD table is read.

    Args:
        candidates: the lengths it may choose (ascending, 0 allowed).
        explore_every: one step in this many measures another length.
        acceptance_fade: per request verified at a length, the weight its
            older accepted counts keep (about 1 / (1 - fade) requests count).
        chains: the lengths are chains (n-gram, suffix, hybrid, a head with
            topk=1), whose first k drafts are the k-chain's: a step verified
            at K also tells every shorter k's acceptance (`verified`).
            False for trees, whose smaller trees are not prefixes.
    """

    def __init__(self, candidates: tuple[int, ...], explore_every: int = 32,
                 switch_margin: float = 0.02, acceptance_fade: float = 0.995,
                 chains: bool = True) -> None:
        if not candidates or list(candidates) != sorted(set(candidates)) or candidates[0] < 0:
            raise ValueError(f"candidates must be ascending lengths >= 0, got {candidates}")
        self.candidates = tuple(candidates)
        self.lengths = {k: LengthStats() for k in candidates}
        self.acceptance = LengthAcceptance(self.candidates, acceptance_fade, chains)
        self.times = StepTimes()
        self.tries: dict[tuple[int, int], int] = {}  # (K, bucket) -> explorations
        self.explore_every, self.switch_margin = explore_every, switch_margin
        self.current = candidates[-1]
        self.exploring: int | None = None  # the length an exploration holds
        self.explore_left = 0  # steps it still holds it
        self.explore_credit = 0.0  # seconds explorations may still lose
        self.num_exploring_turns = 0
        self.weighed_batch: int | None = None  # where it last weighed them all (None: next step)
        self.num_unweighed = 0  # steps it kept the length since, without weighing
        self.num_decode_steps = 0
        self.num_kept_steps = 0  # steps its weighings kept the length since it last moved
        self.num_outputs = 0  # step outputs seen (`samples`)
        self._counters: dict | None = None  # `step_counters`' copy
        self.last_path_step = -PATHS_RECENT_STEPS - 1  # num_steps of the last `verified_within`
        self.stats = BatchDraftStats()
        self.last_expected: dict[int, float] = {}  # K -> E[tokens/request] when chosen
        # () -> the focus ratio of a draining batch (wave_focus.py) or None;
        # the scheduler's (None: the batch's mean request, always)
        self.focus = None
        self.focus_ratio: float | None = None  # as of the last weighing
        self._step_ms: dict[str, float] | None = None  # counters' copy of step_ms()
        self._step_ms_at = 0  # num_decode_steps when it was taken
        self._step_windows: dict[str, dict] = {}  # counters' copy of times.windows()

    def __getitem__(self, batch_size: int) -> int:
        started = time.perf_counter()
        k = self.choose(int(batch_size))
        self.stats.host_seconds += time.perf_counter() - started
        return k

    def choose(self, batch_size: int) -> int:
        self.stats.num_steps += 1
        if self.explore_left > 0:
            self.explore_left -= 1
            return self.exploring
        if self.stats.num_steps % DECIDE_EVERY and self._near_weighed(batch_size):
            self.num_unweighed += 1
            return self._keep()
        steps, self.num_unweighed, self.weighed_batch = 1 + self.num_unweighed, 0, None
        self._take_focus()
        estimates = {k: self.times.estimate(k, batch_size, self.current)
                     for k in self.candidates}
        if estimates[self.current] is not None:
            step = estimates[self.current][0]
            self.explore_credit = min(self.explore_credit + EXPLORE_SHARE * step * steps,
                                      MAX_EXPLORE_CREDIT * step)
            unknown = [k for k in self.candidates if estimates[k] is None
                       and self.tries.get((k, batch_bucket(batch_size)), 0) < 4 * MIN_SAMPLES]
            if unknown:
                self.num_kept_steps = 0
                return self._hold(unknown[-1], batch_size)
            if self.stats.num_steps % self.explore_every == 0:
                k = self._affordable(self._next_to_explore(), batch_size, estimates)
                if k is not None:
                    return self._hold(k, batch_size)
            before = self.current
            self._switch(batch_size, {k: e for k, e in estimates.items() if e is not None})
            self.num_kept_steps = self.num_kept_steps + steps if self.current == before else 0
            self.weighed_batch = batch_size  # all measured here: weigh again in DECIDE_EVERY
        else:  # the current length is being measured in this bucket first
            self.num_kept_steps = 0
        return self._keep()

    @property
    def sample_every(self) -> int:
        """1, or `SETTLED_FACTOR` once settled (`SETTLE_STEPS`)."""
        return SETTLED_FACTOR if self.num_kept_steps >= SETTLE_STEPS else 1

    def samples(self, verified_k: int, drafted_k: int) -> bool:
        """Whether the scheduler reads this step output's acceptance and time:
        every step until settled, and every step that verified or drafted
        another length than the current one (a try, a change); else one in
        `sample_every`."""
        self.num_outputs += 1
        return (verified_k != self.current or drafted_k != self.current
                or self.num_outputs % self.sample_every == 0)

    def _near_weighed(self, batch_size: int) -> bool:
        """Whether the batch is within `REWEIGH_BATCH_SHARE` of the one it
        last weighed the lengths at (a batch drifts by a request or two)."""
        last = self.weighed_batch
        return last is not None and abs(batch_size - last) <= REWEIGH_BATCH_SHARE * last

    def _keep(self) -> int:
        """This step runs the current length."""
        self.lengths[self.current].num_chosen += 1
        self.last_expected[self.current] = self.expected_tokens(self.current)
        return self.current

    def _switch(self, batch_size: int, estimates: dict[int, tuple[float, float]]) -> None:
        """Move to the length with the most expected tokens per second if it
        beats the current one by `switch_margin` plus, for a shorter one, the
        noise of the two times (their relative standard errors combined): the
        best of several noisy estimates is biased upwards, and where lengths
        cost about the same (a latency-bound batch), a noisy time would
        otherwise move the batch to a shorter length for a saving that is not
        there. Else move to the longest length whose time is within the margin
        of the current one's."""
        rates = {k: batch_size * self.gain(k) / max(t, 1e-9)
                 for k, (t, _) in estimates.items()}
        best = max(rates, key=rates.get)
        noise = (SWITCH_Z * math.hypot(estimates[best][1], estimates[self.current][1])
                 if best < self.current else 0.0)
        if rates[best] > rates[self.current] * (1 + self.switch_margin + noise):
            self.current = best
            return
        # A longer length expects at least the current one's tokens, so one
        # that costs no more than the margin loses at most that: take the
        # longest such. Its own estimate may be stale (measured under another
        # load, the faded mean of rare explorations) and show no gain, and a
        # latency-bound batch would otherwise keep a short length a larger
        # batch chose (docs/results/batch_draft_length_h200_run4)
        time_now = estimates[self.current][0]
        cheap = [k for k, (t, _) in estimates.items()
                 if k > self.current and t <= time_now * (1 + self.switch_margin)]
        if cheap:
            self.current = max(cheap)

    def _next_to_explore(self) -> list[int]:
        """The lengths to try, preferred first: those whose acceptance is
        stale (`LengthAcceptance.stale`: learnt on other requests), the
        current length's neighbours in turn (where the best length moves to
        as the batch changes, and cheap to try), and every `FAR_EVERY`-th
        time first the length measured least recently. While a tree's paths
        teach the shorter sizes their acceptance, those are tried for their
        time on one turn in `TIME_ONLY_EVERY` only."""
        self.num_exploring_turns += 1
        i = self.candidates.index(self.current)
        near = [self.candidates[j] for j in (i - 1, i + 1) if 0 <= j < len(self.candidates)]
        turn = self.num_exploring_turns % max(len(near), 1)
        near = near[turn:] + near[:turn]
        others = [k for k in self.candidates if k != self.current]
        stale = [k for k in self.acceptance.stale() if k != self.current]
        if self.num_exploring_turns % FAR_EVERY == 0 or not near:
            far = min(others, key=lambda k: self.lengths[k].last_measured, default=None)
            preferred = stale + [k for k in [far] + near if k is not None]
        else:
            preferred = stale + near
        recent = PATHS_RECENT_STEPS * self.sample_every  # paths recorded that much rarer
        if (self.stats.num_steps - self.last_path_step <= recent
                and self.num_exploring_turns % TIME_ONLY_EVERY != 0):
            # the paths teach the shorter sizes: on this turn, only longer ones
            return [k for k in preferred if k > self.current]
        return preferred

    def _affordable(self, preferred: list[int], batch_size: int,
                    estimates: dict) -> int | None:
        """The first of `preferred` whose `HOLD_STEPS` steps' expected loss fits the
        exploration credit, paid out of it; None when none fits. The credit
        grows by `EXPLORE_SHARE` of each step's (predicted) seconds; a loss is
        the extra seconds its steps at k take for their tokens at the current
        length's rate. On SmolLM2 on CPU (batch 16 and 80) K=5 took over 2x
        the time of K=0 per token, and one try in 32 steps of it alone cost
        3-4%; seconds, not steps, because a batch-80 step costs many batch-1
        steps. A try also changes length twice (`switch_penalty`)."""
        seconds = estimates[self.current][0]
        current = batch_size * self.gain(self.current) / seconds
        changes = 2 * seconds * self.switch_penalty()  # into k and back
        for k in preferred:
            rate = (None if estimates.get(k) is None
                    else batch_size * self.gain(k) / estimates[k][0])
            cost = (0.0 if rate is None
                    else HOLD_STEPS * seconds * max(current / rate - 1.0, 0.0) + changes)
            if cost <= self.explore_credit:
                self.explore_credit -= cost
                self.stats.num_explored += 1
                return k
        return None

    def switch_penalty(self) -> float:
        """How much longer a step that changes length (or is the first after
        a change) runs than a settled decode step, relative to it (0 until
        each kind has `MIN_KIND_STEPS` steps): a try pays it twice. On CPU
        (batch 16) 52 ms against 29; on the H200 at batch 64 8.2 ms against
        4.9, at batch 1 and 16 none (docs/results/batch_draft_length_cpu_run7,
        batch_draft_length_h200_run8)."""
        s = self.stats
        if min(s.switch_steps, s.decode_steps) < MIN_KIND_STEPS:
            return 0.0
        ratio = (s.switch_seconds / s.switch_steps) / max(s.decode_seconds / s.decode_steps, 1e-9)
        return max(ratio - 1.0, 0.0)

    def _hold(self, k: int, batch_size: int) -> int:
        """Try `k` for `HOLD_STEPS` steps: only the last both drafts and
        verifies k after a step that did too, and counts for its time."""
        self.exploring, self.explore_left = k, HOLD_STEPS - 1
        key = (k, batch_bucket(batch_size))
        self.tries[key] = self.tries.get(key, 0) + 1
        return k

    def expected_tokens(self, k: int) -> float:
        """E[tokens a request gains per step | K = k] (`LengthAcceptance`)."""
        return self.acceptance.expected(k)

    def gain(self, k: int) -> float:
        """What a step at k is weighed by: the batch's mean request's
        expected tokens, or, in a draining batch, those of the request with
        the most steps left (`focus_ratio`, wave_focus.py)."""
        expected = self.expected_tokens(k)
        if self.focus_ratio is None:
            return expected
        return 1.0 + self.focus_ratio * (expected - 1.0)

    def _take_focus(self) -> None:
        """The focus for this weighing (None while requests wait)."""
        self.focus_ratio = self.focus() if self.focus is not None else None
        if self.focus_ratio is not None:
            self.stats.num_focused += 1
            self.stats.focus_ratio_sum += self.focus_ratio

    def verified(self, k: int, num_accepted: list[int]) -> None:
        """A step verified `k` drafts per request; `num_accepted` per request
        (`LengthAcceptance.verified`). Steps at the length it exploits also
        count in expected vs realised (the expectation it had when it last
        chose that length)."""
        if k not in self.lengths or not num_accepted:
            return
        self.acceptance.verified(k, num_accepted)
        if k == self.current and k in self.last_expected:
            self.stats.expected_tokens += self.last_expected[k] * len(num_accepted)
            self.stats.realised_tokens += len(num_accepted) + sum(num_accepted)
            self.stats.num_requests += len(num_accepted)

    def verified_within(self, k: int, path_ranks) -> None:
        """A tree step verified `k` drafts per request; `path_ranks` [n, N -
        1] the node ranks of each request's accepted path
        (`LengthAcceptance.verified_within`): every shorter length learns
        what its tree would have had accepted."""
        self.acceptance.verified_within(k, path_ranks)
        self.stats.num_path_steps += 1
        self.last_path_step = self.stats.num_steps

    def measured(self, k: int, batch_size: int, seconds: float) -> None:
        """A pure decode step of `batch_size` requests that verified and
        drafted `k` took `seconds`."""
        if k not in self.lengths or seconds <= 0:
            return
        self.num_decode_steps += 1
        expected = self.times.estimate(k, batch_size, self.current)
        self.stats.trace_step(k, batch_size, seconds, expected, self.times.host, self.current)
        if expected is not None:
            self.stats.priced(k, seconds, expected[0])
        # the length it runs tells the host's speed (StepTimes.host); a
        # length tried now and then does not
        if not self.times.add(k, batch_size, seconds, follow_host=k == self.current):
            self.stats.num_stalled += 1
            return
        self.lengths[k].last_measured = self.num_decode_steps
        self.stats.num_measured += 1

    def stepped(self, kind: str, seconds: float) -> None:
        """A step of `kind` (`STEP_KINDS`) took `seconds` since the output
        before it, whether or not its time counts for a length."""
        setattr(self.stats, f"{kind}_steps", getattr(self.stats, f"{kind}_steps") + 1)
        setattr(self.stats, f"{kind}_seconds", getattr(self.stats, f"{kind}_seconds") + seconds)

    def step_counters(self) -> dict:
        """`counters`, taken again on one step in `sample_every` (as the
        step outputs are read) and handed out as they were in between."""
        if self._counters is None or self.stats.num_steps % self.sample_every == 0:
            self._counters = self.counters()
        return self._counters

    def counters(self) -> dict:
        """What it decided so far, cheap enough to read every step (the
        scheduler hands it to the workers with each step, which merge it
        into their copy: `BatchPolicyView`; bench reads it there): the
        length it runs, the steps each length was chosen for, the expected
        vs realised tokens per request summed, and as of now
        (`SNAPSHOT_KEYS`) the tokens per request it expects of each length;
        its typical step times (a quantile per length and bucket) with what
        their windows hold (`StepTimes.windows`) only when taken again,
        every `STEP_MS_EVERY` decode steps: they are most of its size, and
        every step's copy crosses to the workers' processes."""
        s = self.stats
        times = {}
        if self._step_ms is None or self.num_decode_steps - self._step_ms_at >= STEP_MS_EVERY:
            self._step_ms, self._step_ms_at = self.step_ms(), self.num_decode_steps
            self._step_windows = self.times.windows()
            times = {"step_ms": self._step_ms, "step_windows": self._step_windows}
        return {"current": self.current, "num_steps": s.num_steps,
                "num_explored": s.num_explored, "num_measured": s.num_measured,
                "num_stalled": s.num_stalled, "num_first_at_shape": s.num_first_at_shape,
                "num_relearned": self.acceptance.num_relearned,
                "num_path_steps": s.num_path_steps, "num_focused": s.num_focused,
                "focus_ratio_sum": s.focus_ratio_sum,
                **{f"{kind}_{unit}": getattr(s, f"{kind}_{unit}") for kind in STEP_KINDS
                   for unit in ("steps", "seconds")},
                "chosen": {k: self.lengths[k].num_chosen for k in self.candidates},
                "expected_tokens": s.expected_tokens, "realised_tokens": s.realised_tokens,
                "num_requests": s.num_requests, "priced_steps": dict(s.priced_steps),
                "priced_seconds": dict(s.priced_seconds),
                "expected_seconds": dict(s.expected_seconds),
                "expected_per_length": {k: round(self.expected_tokens(k), 3)
                                        for k in self.candidates},
                "host_speed": round(self.times.host, 3), "host_seconds": s.host_seconds,
                **times}

    def step_ms(self) -> dict[str, float]:
        """"K@batch" -> typical step time in ms at that batch size (its
        bucket's smallest, `StepTimes.typical`)."""
        typical = {key: self.times.typical(*key) for key in sorted(self.times.samples)}
        return {f"{k}@{bucket_batch(b)}": round(1e3 * t, 3)
                for (k, b), t in typical.items() if t is not None}

    def as_dict(self) -> dict:
        s = self.stats
        return {**self.counters(), "candidates": list(self.candidates),
                "expected_tokens_per_request": (s.expected_tokens / s.num_requests
                                                if s.num_requests else None),
                "realised_tokens_per_request": (s.realised_tokens / s.num_requests
                                                if s.num_requests else None),
                "step_ms": self.step_ms(), "step_windows": self.times.windows()}
