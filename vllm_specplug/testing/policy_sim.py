"""A simulated engine for the batch draft-length policy
(adaptive/batch_draft_length.py; issue 27): steps whose acceptance and time
follow a cost model with the noise of each kind of host, driven as the
scheduler drives the policy. Used by the policy's unit tests
(tests/test_batch_draft_length_unit.py, tests/test_batch_draft_length_phases_unit.py,
tests/test_policy_replay.py) and benchmarks/policy_noise.py."""
from __future__ import annotations

import numpy as np

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength
from vllm_specplug.adaptive.wave_focus import RequestGains
from vllm_specplug.proposers.head_graphs import padded_batch


class ChainEngine:
    """A fake engine: draft token i is accepted, given those before were,
    with probability `rates[i]`; a step of b requests at length K takes
    fixed + per_token * b * (K + 1) + per_draft * K seconds (verification's
    tokens, and K sequential drafting passes), plus per_request * b, with 3%
    noise (or `noise`); the first step that verifies a new length takes
    `settle` seconds more (the H200, docs/results/batch_draft_length_h200_run7).
    `found`: each request finds a draft with this probability (n-gram and
    suffix; a step verifies K tokens for those only), or (probability of a
    burst, `found` in a burst, `found` otherwise): most requests drafting at
    once now and then, so that a step's own work at K is skewed to the slow
    side as suffix's was on SmolLM2 (its K=5 steps' mean 1.35x their median
    at batch 16, docs/results/batch_draft_length_cpu_run19); `stalls`:
    (probability, low, high), a step that many times slower, uniform in
    [low, high] (the 2-core CPU, docs/results/batch_draft_length_cpu_run18);
    `drift`: (steps, low, high), the host's speed drawn again, uniform in
    [low, high], every that many steps (a CPU's own repeats moved 1.5x, the
    H200 beside other engines 1.5-2x), from a stream of its own: every
    engine of one seed sees the same host."""

    def __init__(self, rates, fixed, per_token, per_draft, seed=0, first_slow=False,
                 padded=False, floor=0.0, noise=0.03, per_request=0.0, settle=0.0, speed=1.0,
                 found=1.0, stalls=(0.0, 1.0, 1.0), drift=None):
        self.found, self.stalls, self.drift, self.num_steps = found, stalls, drift, 0
        self.rates, self.floor = rates, floor  # floor: a latency-bound step's seconds
        self.settle, self.speed = settle, speed  # speed: the host's, a factor on every step
        self.noise, self.per_request = noise, per_request
        self.fixed, self.per_token, self.per_draft = fixed, per_token, per_draft
        self.rng = np.random.default_rng(seed)
        self.host_rng = np.random.default_rng([seed, 1])
        # the first step at each (K, batch size) 100x slower: a drafting graph
        # captured on first use (200-450 ms against 4 on the H100); `padded`:
        # per (K, padded batch size), as the head captures
        self.first_slow, self.seen, self.padded = first_slow, set(), padded
        self.steps: list[tuple[int, int]] = []  # (K, requests) of each step timed

    def expected_rate(self, k: int, num_reqs: int) -> float:
        """Tokens per second of a step at `k` with `num_reqs` requests by
        the cost model's means (no noise, the stalls' mean slowdown, the
        host at speed 1, not settling, no first-step capture)."""
        found = self.found
        if isinstance(found, tuple):
            burst, inside, outside = found
            found = burst * inside + (1 - burst) * outside
        accepted, reached = 0.0, 1.0
        for rate in self.rates[:k]:
            reached *= rate
            accepted += reached
        stall, low, high = self.stalls
        seconds = ((self.fixed + max(self.floor, self.per_token * num_reqs * (1 + k * found))
                    + self.per_draft * k + self.per_request * num_reqs)
                   * (1 - stall + stall * (low + high) / 2))
        return num_reqs * (1 + found * accepted) / seconds

    def accepted(self, k: int, num_reqs: int) -> list[int]:
        counts, found = [], self._found()
        for _ in range(num_reqs):
            n = 0
            while n < k and self.rng.random() < self.rates[n]:
                n += 1
            counts.append(n if found == 1.0 or self.rng.random() < found else 0)
        return counts

    def _found(self) -> float:
        """This step's share of requests with a draft (`found`)."""
        if not isinstance(self.found, tuple):
            return self.found
        burst, inside, outside = self.found
        return inside if self.rng.random() < burst else outside

    def seconds(self, k: int, num_reqs: int, settling: bool = False) -> float:
        self.steps.append((k, num_reqs))
        found = self._found()
        num_drafted = num_reqs if found == 1.0 else self.rng.binomial(num_reqs, found)
        mean = (self.fixed + max(self.floor, self.per_token * (num_reqs + k * num_drafted))
                + self.per_draft * k + self.per_request * num_reqs
                + (self.settle if settling else 0.0))
        shape = (k, padded_batch(num_reqs) if self.padded else num_reqs)
        if self.first_slow and shape not in self.seen:
            self.seen.add(shape)
            mean *= 100
        if self.stalls[0] and self.rng.random() < self.stalls[0]:
            mean *= self.rng.uniform(*self.stalls[1:])
        if self.drift is not None and self.num_steps % self.drift[0] == 0:
            self.speed = self.host_rng.uniform(*self.drift[1:])
        self.num_steps += 1
        return self.speed * mean * self.rng.uniform(1 - self.noise, 1 + self.noise)


def run_steps(engine: ChainEngine, batch, num_steps: int, choose) -> float:
    """Tokens per second over `num_steps` steps of `batch` requests (or
    `batch()` each step), as the scheduler drives it: the length chosen at
    step t is drafted in step t and verified in t + 1."""
    tokens, elapsed, history = 0, 0.0, [0, 0]
    for _ in range(num_steps):
        num_reqs = batch() if callable(batch) else batch
        accepted, seconds = one_step(engine, choose, num_reqs, history)
        tokens += num_reqs + sum(accepted)
        elapsed += seconds
    return tokens / elapsed


def one_step(engine: ChainEngine, choose, num_reqs: int, history: list[int]):
    """One step as the scheduler observes it: `history` holds the lengths
    the two steps before drafted (the last one's verify now), and is moved
    on. Timed only when settled (integration/batch_schedule.py).
    (accepted per request, seconds)."""
    two_before, verified_k = history
    drafted_k = choose[num_reqs] if isinstance(choose, BatchDraftLength) else choose(num_reqs)
    accepted = engine.accepted(verified_k, num_reqs)
    seconds = engine.seconds(max(verified_k, drafted_k), num_reqs,
                             settling=verified_k != two_before)
    if isinstance(choose, BatchDraftLength):
        choose.verified(verified_k, accepted if verified_k else [])
        if two_before == verified_k == drafted_k:
            choose.measured(verified_k, num_reqs, seconds)
    history[:] = [verified_k, drafted_k]
    return accepted, seconds


RATES = [0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35]  # falling with position


def stalling_suffix(num_reqs: int) -> dict:
    """The 2-core CPU: one step in five runs 1.5-4x slow whatever its length
    (SmolLM2's suffix steps at K=5 and batch 16: 70 to 552 ms, median 96;
    docs/results/batch_draft_length_cpu_run18), and a suffix-like method
    drafts for half the requests, so a step's own work varies too. At batch
    16 and 80, K=1 and no speculation are best, K=5 14-37% behind
    (benchmarks/policy_noise.py)."""
    return dict(rates=[0.6, 0.55, 0.5, 0.5, 0.5], fixed=0.03 * num_reqs ** 0.4,
                per_token=3.5e-3, per_draft=0.0, noise=0.1, found=0.5, stalls=(0.2, 1.5, 4.0))


def run_phases(engine: ChainEngine, phases, choose, seed: int,
               starts: list[int] | None = None) -> list[float]:
    """Tokens per second of each phase, as `bench offline` runs them: a phase
    of b > 1 starts b requests of 24-96 tokens and drains as they finish (so
    the batch-80 phase passes through every smaller batch size); batch 1
    runs 3 requests one after another. `starts`, if given, gets the index
    in `engine.steps` where each phase starts."""
    rng = np.random.default_rng(seed)
    rates, history = [], [0, 0]
    for batch_size in phases:
        if starts is not None:
            starts.append(len(engine.steps))
        needs = rng.integers(24, 97, size=3 if batch_size == 1 else batch_size)
        groups = [[n] for n in needs] if batch_size == 1 else [list(needs)]
        tokens, elapsed = 0, 0.0
        for group in groups:
            more_tokens, seconds = drain(engine, group, choose, history)
            tokens, elapsed = tokens + more_tokens, elapsed + seconds
        rates.append(tokens / elapsed)
    return rates


def expected_over_best(engine: ChainEngine, steps, candidates) -> float:
    """How close `steps` [(K, requests)] of `engine` came to the best
    length for each step's batch size, by the cost model's means
    (`expected_rate`): the seconds that length would take for the steps'
    tokens over the seconds theirs took, each step a request's tokens. A
    ratio without the run's noise: the best static length of one noisy run
    is the best of several draws, biased upwards (`cpu_phases`' best length
    by its mean over 40 seeds read 0.965 / 0.978 / 0.990 of that at batch
    1 / 16 / 80; benchmarks/policy_noise.py)."""
    best = {b: max(engine.expected_rate(k, b) for k in candidates) for _, b in steps}
    taken = sum(b / engine.expected_rate(k, b) for k, b in steps)
    return sum(b / best[b] for _, b in steps) / taken


def drain(engine: ChainEngine, left: list, choose, history: list[int]):
    """Decode steps until every request of `left` (the tokens each still
    needs) ends (`history` as `one_step`): (tokens, seconds)."""
    tokens, elapsed = 0, 0.0
    while left:
        num_reqs = len(left)
        accepted, seconds = one_step(engine, choose, num_reqs, history)
        tokens, elapsed = tokens + num_reqs + sum(accepted), elapsed + seconds
        left = [n - 1 - a for n, a in zip(left, accepted) if n - 1 - a > 0]
    return tokens, elapsed


def drain_wave(engine: ChainEngine, choose, rates: dict[str, float], num_tokens: int,
          gains: RequestGains) -> float:
    """Seconds one draining wave takes: each request (its own per-draft
    acceptance rate, `rates`) needs `num_tokens` tokens, nothing waits, a
    request leaves when done; the scheduler's part as integration/
    batch_schedule.py plays it (the length chosen at step t is drafted in t
    and verified in t + 1; each request's accepted drafts to `gains`)."""
    left, elapsed, history = dict.fromkeys(rates, num_tokens), 0.0, [0, 0]
    if isinstance(choose, BatchDraftLength):
        choose.focus = lambda: gains.focus(left.items(), choose.expected_tokens(choose.current))
    while left:
        num_reqs, (two_before, verified_k) = len(left), history
        drafted_k = choose[num_reqs] if isinstance(choose, BatchDraftLength) else choose
        accepted = {}
        for req_id in left:
            n = 0
            while n < verified_k and engine.rng.random() < rates[req_id]:
                n += 1
            accepted[req_id] = n
        seconds = engine.seconds(max(verified_k, drafted_k), num_reqs,
                                 settling=verified_k != two_before)
        if isinstance(choose, BatchDraftLength) and verified_k:
            expected = choose.expected_tokens(verified_k) - 1.0
            for req_id, n in accepted.items():
                gains.observed(req_id, n, expected)
            choose.verified(verified_k, list(accepted.values()))
        if isinstance(choose, BatchDraftLength) and two_before == verified_k == drafted_k:
            choose.measured(verified_k, num_reqs, seconds)
        for req_id, n in accepted.items():
            left[req_id] -= 1 + n
            if left[req_id] <= 0:
                del left[req_id]
                gains.forget([req_id])
        elapsed += seconds
        history[:] = [verified_k, drafted_k]
    return elapsed
