"""One draft length per step for the whole batch (adaptive/batch_draft_length.py;
issue 27) on a simulated engine (vllm_specplug/testing/policy_sim.py),
against every static length, at a steady batch. Draining phases, step times
across batch sizes, the worker's copy and the trace:
tests/test_batch_draft_length_phases_unit.py. The scheduler side (the
capture table, what each step's output tells the policy, its channel,
bench's reports): tests/test_batch_draft_schedule_unit.py."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates
from vllm_specplug.adaptive.wave_focus import RequestGains
from vllm_specplug.testing.policy_sim import RATES, ChainEngine, run_steps


@pytest.mark.parametrize("num_reqs", [1, 16, 64, 128])
def test_within_5_percent_of_the_best_static_length(num_reqs):
    """A GPU-like cost (little per token until the batch is large, drafting
    passes dear at small batches): the best static length moves from 8 at
    batch 1 to none at 128; the policy finds it at each batch size, paying
    for its exploration out of the margin."""
    candidates = draft_length_candidates(8)
    engine_args = dict(rates=RATES, fixed=4e-3, per_token=2e-5, per_draft=3e-4)
    static = {k: run_steps(ChainEngine(**engine_args, seed=1), num_reqs, 2000, lambda b, k=k: k)
              for k in candidates}
    policy = BatchDraftLength(candidates)
    adaptive = run_steps(ChainEngine(**engine_args, seed=1), num_reqs, 2000, policy)
    best = max(static, key=static.get)
    assert adaptive >= 0.95 * static[best], (num_reqs, best, static, policy.as_dict())
    assert policy.current == best or static[policy.current] >= 0.97 * static[best]


def test_noisy_times_of_lengths_that_cost_the_same_keep_the_longest():
    """Batch 1 on the H100: every length's step took 3-4 ms, each moving
    about 20% (docs/results/batch_draft_length_h100_run2), and the adaptive
    tree spent 60% of its steps at 4 or 8 nodes where 15 was best
    (docs/results/batch_draft_length_h100_run3). Here too, lengths that cost
    the same up to 20% noise, over six seeds: the policy stays on the longest
    (a move to a shorter length needs a gain beyond the times' noise), within
    2% of it. Before that rule it spent 44% of its steps on shorter lengths
    and fell 3% behind."""
    candidates = draft_length_candidates(8)
    engine_args = dict(rates=RATES, fixed=3e-3, per_token=2e-5, per_draft=2e-5, noise=0.2)
    shares, ratios = [], []
    for seed in range(6):
        longest = run_steps(ChainEngine(**engine_args, seed=seed), 1, 2000, lambda b: 8)
        policy = BatchDraftLength(candidates)
        ratios.append(run_steps(ChainEngine(**engine_args, seed=seed), 1, 2000, policy) / longest)
        chosen = {k: policy.lengths[k].num_chosen for k in candidates}
        shares.append(chosen[8] / sum(chosen.values()))
    assert np.mean(shares) >= 0.75, shares
    assert min(ratios) >= 0.98, ratios


@pytest.mark.parametrize("num_reqs", [1, 64])
def test_one_off_slow_steps_do_not_mislead_it(num_reqs):
    """The first step at each length 100x slower (a graph captured on first
    use): the lower quartile keeps it out, and the best length is still found."""
    engine_args = dict(rates=RATES, fixed=4e-3, per_token=2e-5, per_draft=3e-4)
    static = {k: run_steps(ChainEngine(**engine_args, seed=4), num_reqs, 2000, lambda b, k=k: k)
              for k in draft_length_candidates(8)}
    policy = BatchDraftLength(draft_length_candidates(8))
    run_steps(ChainEngine(**engine_args, seed=4, first_slow=True), num_reqs, 2000, policy)
    assert policy.current == max(static, key=static.get), policy.as_dict()


def test_captures_at_every_padded_size_do_not_price_a_length_out():
    """Batches of 33-64 requests, and the first step at each (K, padded
    size: 40, 48, 56, 64) 100x slower, so a length's first samples in the
    bucket may all be captures (the H100 run's 8@64 at 34 ms against 6 at
    K=4, diag_after.txt): the stall guard drops them, and the policy ends
    on the best static length."""
    engine_args = dict(rates=RATES, fixed=4e-3, per_token=2e-5, per_draft=3e-4)
    sizes = lambda rng=np.random.default_rng(7): int(rng.integers(33, 65))  # noqa: E731
    static = {k: run_steps(ChainEngine(**engine_args, seed=5), 48, 1500, lambda b, k=k: k)
              for k in draft_length_candidates(8)}
    policy = BatchDraftLength(draft_length_candidates(8))
    run_steps(ChainEngine(**engine_args, seed=5, first_slow=True, padded=True), sizes, 1500, policy)
    best = max(static, key=static.get)
    assert policy.current == best or static[policy.current] >= 0.97 * static[best], (
        static, policy.as_dict())
    assert policy.stats.num_stalled > 0, policy.as_dict()


def test_a_step_that_returned_early_does_not_reject_the_rest():
    """Only typical times (3 samples or more) are references: one short
    interval (outputs queued behind a host stall) is not one."""
    policy = BatchDraftLength((0, 4))
    policy.measured(4, 16, 0.001)
    for _ in range(3):
        policy.measured(4, 16, 0.010)
    assert policy.stats.num_stalled == 0
    assert policy.times.typical(4, 5) == pytest.approx(0.010)
    policy.measured(0, 16, 0.5)  # 50x the step at K=4, which does more work: a stall
    assert policy.stats.num_stalled == 1


def test_it_follows_the_batch_as_it_grows():
    """Batch 1 for 1000 steps, then 128: the length drops from the best at
    batch 1 to the best at 128, and that phase runs within 8% of its best
    static length."""
    engine_args = dict(rates=RATES, fixed=4e-3, per_token=2e-5, per_draft=3e-4)
    policy = BatchDraftLength(draft_length_candidates(8))
    run_steps(ChainEngine(**engine_args, seed=2), 1, 1000, policy)
    at_1 = {k: run_steps(ChainEngine(**engine_args, seed=2), 1, 1000, lambda b, k=k: k)
            for k in policy.candidates}
    assert policy.current == max(at_1, key=at_1.get) == 4
    adaptive = run_steps(ChainEngine(**engine_args, seed=3), 128, 1000, policy)
    static = {k: run_steps(ChainEngine(**engine_args, seed=3), 128, 1000, lambda b, k=k: k)
              for k in policy.candidates}
    best = max(static, key=static.get)
    assert best < 4 and policy.current == best
    assert adaptive >= 0.92 * static[best]


def test_a_latency_bound_batch_does_not_price_a_large_one():
    """A GPU-like step that costs the same at every length for a small
    batch (latency-bound) and grows with the tokens for a large one: after
    batch 1, where every length costs alike and a long one wins, batch 256
    measures its lengths rather than carry batch 1's equal times over, and
    ends on the best static length there."""
    engine_args = dict(rates=RATES, fixed=1e-3, per_token=1e-5, per_draft=0.0, floor=3e-3)
    policy = BatchDraftLength(draft_length_candidates(8))
    run_steps(ChainEngine(**engine_args, seed=2), 1, 500, policy)
    assert policy.current >= 4  # 4 and 8 within 2% at batch 1
    static = {k: run_steps(ChainEngine(**engine_args, seed=3), 256, 150, lambda b, k=k: k)
              for k in policy.candidates}
    adaptive = run_steps(ChainEngine(**engine_args, seed=3), 256, 150, policy)
    best = max(static, key=static.get)
    assert best < 8 and static[policy.current] >= 0.97 * static[best], (static, policy.as_dict())
    assert adaptive >= 0.85 * static[best]  # 150 steps, measuring 4 lengths included


def test_expected_tokens_never_fall_with_length():
    policy = BatchDraftLength((0, 1, 2, 4), chains=False)  # trees: each length its own
    policy.verified(1, [1, 1, 0, 1])  # 1.75 tokens a request at K=1
    policy.verified(2, [0, 1, 0, 0])  # 1.25 at K=2, less than K=1 by chance
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(1) == pytest.approx(1.75)
    assert policy.expected_tokens(2) == pytest.approx(1.75)  # kept non-decreasing
    assert policy.expected_tokens(4) == 5.0  # not verified yet: at its best, to be tried


def test_a_chains_steps_also_tell_its_shorter_lengths_acceptance():
    """A chain of 4 drafts whose first k are the k-chain's: a request that
    accepted a of 4 would have accepted min(a, k) of k. On SmolLM2/CPU the
    shorter lengths' own rare explorations (with the non-decreasing rule)
    had the policy expect 1.51 tokens a request where 1.38-1.45 came."""
    policy = BatchDraftLength((0, 1, 2, 4))
    policy.verified(4, [0, 1, 3, 4])
    assert policy.expected_tokens(1) == pytest.approx(1.75)  # min(a, 1): 0 1 1 1
    assert policy.expected_tokens(2) == pytest.approx(2.25)  # min(a, 2): 0 1 2 2
    assert policy.expected_tokens(4) == pytest.approx(3.0)
    policy.verified(2, [2, 2, 2, 2])  # says nothing of 4
    assert policy.acceptance.lengths[4].num_requests == pytest.approx(4)


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


def test_after_a_large_batch_chose_short_a_latency_bound_batch_returns_to_the_longest():
    """The H200 run (docs/results/batch_draft_length_h200_run4): the batch-256
    phase left the policy on a short tree, with acceptance as low as there;
    at batch 1, where every length cost the same, it stayed on 8 nodes for
    66% of the steps, expecting 3.39 tokens where 3.96 came. A longer length
    is expected to gain at least the shorter's tokens; a stale estimate adds
    nothing to that, and a move needed a 2% gain. Here: batch 256 with low
    acceptance and tokens dear (the best static length short), then batch 1,
    latency-bound (every length alike, 3% noise), acceptance high: over four
    seeds the policy spends most of batch 1 on the longest, within 3% of it."""
    candidates = draft_length_candidates(8)
    busy = dict(rates=[0.5, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1], fixed=1e-3, per_token=1e-5,
                per_draft=0.0)
    idle = dict(rates=[0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6], fixed=1e-3, per_token=1e-6,
                per_draft=0.0, floor=3e-3)
    shares, ratios = [], []
    for seed in range(4):
        policy = BatchDraftLength(candidates)
        run_steps(ChainEngine(**busy, seed=seed), 256, 300, policy)
        assert policy.current < 8, policy.as_dict()
        before = {k: policy.lengths[k].num_chosen for k in candidates}
        longest = run_steps(ChainEngine(**idle, seed=seed), 1, 1500, lambda b: 8)
        ratios.append(run_steps(ChainEngine(**idle, seed=seed), 1, 1500, policy) / longest)
        chosen = {k: policy.lengths[k].num_chosen - before[k] for k in candidates}
        shares.append(chosen[8] / sum(chosen.values()))
    assert min(shares) >= 0.7, shares
    assert min(ratios) >= 0.97, ratios


def test_a_length_is_timed_once_settled_not_right_after_a_change():
    """The H200 (docs/results/batch_draft_length_h200_run7): the first step
    that verified and drafted a new length ran 0.8-1.3 ms over the steady
    step, and a length the policy only explored was timed only there, so
    whatever length it ran looked cheapest: at batch 1, 8 nodes at 2.4 ms
    and 15 at 3.8 ms, where 15 alone took 2.3 ms (8 nodes for 68% of the
    steps); at batch 16, 15 nodes at 3.0 ms and 8 at 3.7. Here, batch 1,
    the first step after a change 0.7 ms slower, 15 nodes dear enough that
    8 is best: 15 is explored only, and its time is taken as settled (within
    5%; timed right after each change, as before, it read 14-16% high and
    15 nodes ran for up to 18% of the steps), and the policy stays within
    4% of the static 8-node tree (15 nodes run at 0.77 of it:
    its tries, three steps each now, and the first steps' measuring cost
    2-3%; no seed of six fell below 0.967)."""
    cost = dict(fixed=2.3e-3, per_token=1e-8, per_draft=1.5e-4, settle=0.7e-3)
    rates = [0.85] * 6 + [0.3] * 9
    settled = {k: cost["fixed"] + cost["per_draft"] * k for k in (8, 15)}
    for seed in range(4):
        policy = BatchDraftLength((8, 15), chains=False)
        best = run_steps(ChainEngine(rates=rates, **cost, seed=seed), 1, 2000, lambda b: 8)
        ratio = run_steps(ChainEngine(rates=rates, **cost, seed=seed), 1, 2000, policy) / best
        timed = {k: policy.times.estimate(k, 1, 8)[0] for k in (8, 15)}
        assert policy.lengths[15].num_chosen < 0.1 * policy.stats.num_steps, policy.as_dict()
        assert all(abs(timed[k] / settled[k] - 1) < 0.05 for k in timed), (timed, settled)
        assert ratio >= 0.96, (ratio, policy.as_dict())


def test_a_length_timed_in_a_slow_spell_is_read_at_the_hosts_speed_now():
    """A host's speed drifts (the H200 beside other engines, 1.5-2x; the
    2-core CPU, where K=0's three samples at batch 1 were older than 15
    nodes' last 32, docs/results/batch_draft_length_cpu_run6). Here, batch
    1: easy requests on a host running at half speed (15 nodes best; K=0
    timed there), then hard requests at full speed, where K=0 is best by
    about 1.4x. With samples kept relative to the host's speed (followed
    through the current length's steps), K=0's old time is read at today's
    speed: over the last 400 steps the policy runs K=0 for at least 85% of
    them, within 9% of it (its tries of 15 nodes cost the rest). Read as
    taken, K=0 looked twice its cost: 51-81% of the steps, 0.84-0.89x."""
    easy = dict(rates=[0.9] * 8 + [0.5] * 7, fixed=10e-3, per_token=1e-9, per_draft=6e-4,
                speed=2.0)
    hard = dict(rates=[0.3] + [0.2] * 14, fixed=10e-3, per_token=1e-9, per_draft=6e-4)
    for seed in range(4):
        policy = BatchDraftLength((0, 15), chains=False)
        run_steps(ChainEngine(**easy, seed=seed), 1, 300, policy)
        assert policy.current == 15, policy.as_dict()
        run_steps(ChainEngine(**hard, seed=seed), 1, 800, policy)
        before = policy.lengths[0].num_chosen
        best = run_steps(ChainEngine(**hard, seed=seed), 1, 400, lambda b: 0)
        ratio = run_steps(ChainEngine(**hard, seed=seed), 1, 400, policy) / best
        share = (policy.lengths[0].num_chosen - before) / 400
        assert share >= 0.85 and ratio >= 0.91, (share, ratio, policy.as_dict())
        # the host ran 2x faster: its speed factor moved down, not all the
        # way to 0.5 (the current length's window takes in part of a
        # lasting change while the factor follows it)
        assert policy.times.host < 0.75, policy.times.host


def test_a_tree_size_learnt_on_other_requests_is_relearnt():
    """The H200 (docs/results/batch_draft_length_h200_run6): after batch 256
    (low acceptance, short trees chosen), batch 1 (easier requests, 15 nodes
    13% dearer a step than 4 and best): the policy's 4-node estimate rose on
    the new requests, the 15-node one kept batch 256's, below it, and it ran
    4 nodes for 37% of the steps. Trees (`chains=False`) learn a size only
    from its own steps. Three rounds of both phases, four seeds: batch 1
    within 3% of the static 15-node tree on average, 6% at worst (before:
    0.92 on average, three seeds at 0.86-0.91 in every round)."""
    candidates = (0, 1, 2, 4, 8, 15)
    busy = dict(rates=[0.8, 0.5, 0.35, 0.25] + [0.15] * 11, fixed=2e-3, per_token=5e-6,
                per_draft=0.0)
    idle = dict(rates=[0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6] + [0.5] * 7, fixed=3.4e-3,
                per_token=1e-7, per_draft=4e-5)
    ratios = []
    for seed in range(4):
        policy = BatchDraftLength(candidates, chains=False)
        for round_ in range(3):
            run_steps(ChainEngine(**busy, seed=seed + 10 * round_), 256, 100, policy)
            longest = run_steps(ChainEngine(**idle, seed=seed), 1, 300, lambda b: 15)
            ratios.append(run_steps(ChainEngine(**idle, seed=seed), 1, 300, policy) / longest)
    assert np.mean(ratios) >= 0.97 and min(ratios) >= 0.94, ratios


def test_a_longer_length_below_a_fresher_shorter_one_is_stale_and_relearns():
    """Trees: 8 drafts learnt on hard requests (1.5 tokens), then 4 on easy
    ones (4.0): 8's mean cannot be right for these requests. It is stale,
    and its next step counts as much as `RELEARN_REQUESTS` of its past."""
    from vllm_specplug.adaptive.length_acceptance import RELEARN_REQUESTS, LengthAcceptance

    acceptance = LengthAcceptance((0, 4, 8), chains=False)
    for _ in range(50):
        acceptance.verified(8, [1, 0])
    for _ in range(50):
        acceptance.verified(4, [3, 3])
    assert acceptance.stale() == [8]
    assert acceptance.expected(8) == acceptance.expected(4) == pytest.approx(4.0)
    acceptance.verified(8, [6, 6])
    mean = 1 + (RELEARN_REQUESTS * 0.5 * acceptance.fade ** 2 + 12) / (
        RELEARN_REQUESTS * acceptance.fade ** 2 + 2)
    assert acceptance.expected(8) == pytest.approx(mean)
    assert acceptance.stale() == [] and acceptance.num_relearned == 1


def test_a_tree_steps_accepted_paths_teach_every_smaller_size():
    """Trees learn a size only from its own steps, unless the step's accepted
    paths come with their nodes' ranks by score (integration/v2/path_ranks.py):
    the tree of l drafts keeps the nodes of rank < l, so a path's nodes of
    rank < l are what it would have had accepted. Through the scheduler's
    `_observe` (the ranks ride on the runner's output, a step late): two
    requests verified 8 drafts, accepting ranks 0 1 2 and 0 (9: past the
    path); 2 drafts learn 1 + 3 / 2 tokens a request, 4 drafts 1 + 4 / 2."""
    from types import SimpleNamespace

    from vllm_specplug.adaptive.length_acceptance import LengthAcceptance
    from vllm_specplug.integration.batch_schedule import PATH_RANKS_ATTR, BatchDraftSchedule

    acceptance = LengthAcceptance((0, 2, 4, 8), chains=False)
    assert acceptance.expected(2) == 3.0 and acceptance.expected(4) == 5.0  # never verified
    scheduler = SimpleNamespace(gains=RequestGains(), draft_length=BatchDraftLength((0, 2, 4, 8), chains=False),
                                _shapes_seen=set(), _channel=None, _drafted_before=8,
                                _drafted_two_before=8,
                                _maybe_log=lambda: None, _first_at_shape=lambda k, out: True)
    spec = {"a": [7] * 8, "b": [7] * 8}
    output = SimpleNamespace(scheduled_spec_decode_tokens=spec,
                             num_scheduled_tokens={r: 9 for r in spec},
                             total_num_scheduled_tokens=18, finished_req_ids=(), num_spec_tokens_to_schedule=8)
    ranks = np.array([[0, 1, 2] + [9] * 5, [0] + [9] * 7])
    runner = SimpleNamespace(req_id_to_index={"a": 0, "b": 1},
                             sampled_token_ids=[[1, 2, 3, 4], [1, 2]])
    setattr(runner, PATH_RANKS_ATTR, (8, ranks))
    BatchDraftSchedule._observe(scheduler, output, runner, 0.01)
    policy = scheduler.draft_length
    assert policy.expected_tokens(8) == pytest.approx(1 + 4 / 2)
    assert policy.expected_tokens(2) == pytest.approx(1 + 3 / 2)
    assert policy.expected_tokens(4) == pytest.approx(1 + 4 / 2)
    chains = LengthAcceptance((0, 2), chains=True)  # chains learn it in `verified`
    chains.verified_within(8, ranks)
    assert chains.expected(2) == 3.0
