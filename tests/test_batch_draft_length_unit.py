"""One draft length per step for the whole batch (adaptive/batch_draft_length.py,
integration/batch_schedule.py; issue 27) on a simulated engine, against every
static length, and the table that makes vLLM capture each candidate."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates


class _ChainEngine:
    """A fake engine: draft token i is accepted, given those before were,
    with probability `rates[i]`; a step of b requests at length K takes
    fixed + per_token * b * (K + 1) + per_draft * K seconds (verification's
    tokens, and K sequential drafting passes), with 3% noise."""

    def __init__(self, rates, fixed, per_token, per_draft, seed=0, first_slow=False):
        self.rates = rates
        self.fixed, self.per_token, self.per_draft = fixed, per_token, per_draft
        self.rng = np.random.default_rng(seed)
        # the first step at each (K, batch size) 100x slower: a drafting graph
        # captured on first use (200-450 ms against 4 on the H100)
        self.first_slow, self.seen = first_slow, set()

    def accepted(self, k: int, num_reqs: int) -> list[int]:
        counts = []
        for _ in range(num_reqs):
            n = 0
            while n < k and self.rng.random() < self.rates[n]:
                n += 1
            counts.append(n)
        return counts

    def seconds(self, k: int, num_reqs: int) -> float:
        mean = self.fixed + self.per_token * num_reqs * (k + 1) + self.per_draft * k
        if self.first_slow and (k, num_reqs) not in self.seen:
            self.seen.add((k, num_reqs))
            mean *= 100
        return mean * self.rng.uniform(0.97, 1.03)


def _run(engine: _ChainEngine, num_reqs: int, num_steps: int, choose) -> float:
    """Tokens per second over `num_steps` steps, as the scheduler drives it:
    the length chosen at step t is drafted in step t and verified in t + 1."""
    tokens, elapsed, verified_k = 0, 0.0, 0
    for _ in range(num_steps):
        drafted_k = choose[num_reqs] if isinstance(choose, BatchDraftLength) else choose(num_reqs)
        accepted = engine.accepted(verified_k, num_reqs)
        seconds = engine.seconds(max(verified_k, drafted_k), num_reqs)
        tokens += num_reqs + sum(accepted)
        elapsed += seconds
        if isinstance(choose, BatchDraftLength):
            choose.verified(verified_k, accepted if verified_k else [])
            if drafted_k == verified_k:
                choose.measured(verified_k, num_reqs, seconds)
        verified_k = drafted_k
    return tokens / elapsed


RATES = [0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35]  # falling with position


@pytest.mark.parametrize("num_reqs", [1, 16, 64, 128])
def test_within_5_percent_of_the_best_static_length(num_reqs):
    """A GPU-like cost (little per token until the batch is large, drafting
    passes dear at small batches): the best static length moves from 8 at
    batch 1 to none at 128; the policy finds it at each batch size, paying
    for its exploration out of the margin."""
    candidates = draft_length_candidates(8)
    engine_args = dict(rates=RATES, fixed=4e-3, per_token=2e-5, per_draft=3e-4)
    static = {k: _run(_ChainEngine(**engine_args, seed=1), num_reqs, 2000, lambda b, k=k: k)
              for k in candidates}
    policy = BatchDraftLength(candidates)
    adaptive = _run(_ChainEngine(**engine_args, seed=1), num_reqs, 2000, policy)
    best = max(static, key=static.get)
    assert adaptive >= 0.95 * static[best], (num_reqs, best, static, policy.as_dict())
    assert policy.current == best or static[policy.current] >= 0.97 * static[best]


@pytest.mark.parametrize("num_reqs", [1, 64])
def test_one_off_slow_steps_do_not_mislead_it(num_reqs):
    """The first step at each length 100x slower (a graph captured on first
    use): the lower quartile keeps it out, and the best length is still found."""
    engine_args = dict(rates=RATES, fixed=4e-3, per_token=2e-5, per_draft=3e-4)
    static = {k: _run(_ChainEngine(**engine_args, seed=4), num_reqs, 2000, lambda b, k=k: k)
              for k in draft_length_candidates(8)}
    policy = BatchDraftLength(draft_length_candidates(8))
    _run(_ChainEngine(**engine_args, seed=4, first_slow=True), num_reqs, 2000, policy)
    assert policy.current == max(static, key=static.get), policy.as_dict()


def test_it_follows_the_batch_as_it_grows():
    """Batch 1 for 1000 steps, then 128: the length drops from the best at
    batch 1 to the best at 128, and that phase runs within 8% of its best
    static length."""
    engine_args = dict(rates=RATES, fixed=4e-3, per_token=2e-5, per_draft=3e-4)
    policy = BatchDraftLength(draft_length_candidates(8))
    _run(_ChainEngine(**engine_args, seed=2), 1, 1000, policy)
    at_1 = {k: _run(_ChainEngine(**engine_args, seed=2), 1, 1000, lambda b, k=k: k)
            for k in policy.candidates}
    assert policy.current == max(at_1, key=at_1.get) == 4
    adaptive = _run(_ChainEngine(**engine_args, seed=3), 128, 1000, policy)
    static = {k: _run(_ChainEngine(**engine_args, seed=3), 128, 1000, lambda b, k=k: k)
              for k in policy.candidates}
    best = max(static, key=static.get)
    assert best < 4 and policy.current == best
    assert adaptive >= 0.92 * static[best]


def test_expected_tokens_never_fall_with_length():
    policy = BatchDraftLength((0, 1, 2, 4))
    policy.verified(1, [1, 1, 0, 1])  # 1.75 tokens a request at K=1
    policy.verified(2, [0, 1, 0, 0])  # 1.25 at K=2, less than K=1 by chance
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(1) == pytest.approx(1.75)
    assert policy.expected_tokens(2) == pytest.approx(1.75)  # kept non-decreasing
    assert policy.expected_tokens(4) == 5.0  # not verified yet: at its best, to be tried


def test_every_candidate_is_measured_before_the_policy_chooses():
    policy = BatchDraftLength((0, 2, 5))
    seen = []
    for _ in range(30):
        seen.append(policy.choose(4))
        if len(seen) > 1 and seen[-1] == seen[-2]:
            policy.measured(seen[-1], 4, 0.01)
    assert set(seen) == {0, 2, 5}
    never = BatchDraftLength((0, 2, 5))  # no step ever counts
    tail = [never.choose(4) for _ in range(100)][-10:]
    assert set(tail) == {5}  # it measures the current length and keeps it
    with pytest.raises(ValueError, match="ascending"):
        BatchDraftLength((3, 1))


@pytest.mark.parametrize("max_k", [1, 3, 5, 15])
def test_capture_table_puts_every_candidate_in_vllms_lookup(max_k):
    """vLLM builds its capture families and its dense lookup from the table
    (`build_dynamic_sd_schedule_lookup`): each candidate must be in it."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from vllm_specplug.integration.batch_schedule import capture_table, table_lengths

    candidates = draft_length_candidates(max_k)
    assert candidates[0] == 0 and candidates[-1] == max_k
    table = capture_table(candidates, max_num_seqs=256)
    dense = build_dynamic_sd_schedule_lookup(table, vllm_max_batch_size=256,
                                             vllm_num_speculative_tokens=max_k)
    assert set(dense[1:]) == set(candidates) == set(table_lengths(table))
