"""The adaptive controller's parts (vllm_specplug/adaptive/) without an
engine: the policy against brute force, the estimators against known truths,
and proposer state through steps whose drafts were cut to nothing."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from vllm_specplug.adaptive.acceptance import AcceptanceEstimator
from vllm_specplug.adaptive.controller import AdaptiveController
from vllm_specplug.adaptive.cost_model import StepCostModel
from vllm_specplug.adaptive.policy import choose_draft_lengths


def _rate(survival, lengths, num_reqs, fixed, per_token):
    expected = num_reqs + sum(float(p[:n].sum()) for p, n in zip(survival, lengths))
    return expected / (fixed + per_token * (num_reqs + sum(lengths)))


@st.composite
def _cases(draw):
    num_drafting = draw(st.integers(1, 3))
    survival = []
    for _ in range(num_drafting):
        rates = draw(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4))
        survival.append(np.cumprod(np.asarray(rates, dtype=np.float64)))
    num_reqs = num_drafting + draw(st.integers(0, 3))
    fixed = draw(st.floats(0.0, 10.0))
    per_token = draw(st.floats(0.01, 2.0))
    return survival, num_reqs, fixed, per_token


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_policy_maximises_expected_tokens_per_second(case):
    survival, num_reqs, fixed, per_token = case
    chosen = choose_draft_lengths(survival, num_reqs, 0, fixed, per_token)
    assert all(0 <= n <= len(p) for n, p in zip(chosen, survival))
    best = max(_rate(survival, lengths, num_reqs, fixed, per_token) for lengths in
               itertools.product(*[range(len(p) + 1) for p in survival]))
    assert _rate(survival, chosen, num_reqs, fixed, per_token) >= best * (1 - 1e-9)


def test_policy_extremes():
    sure = [np.ones(4), np.ones(4)]
    # a step whose cost does not grow with its tokens: verify every draft
    assert choose_draft_lengths(sure, 2, 0, 1.0, 1e-9) == [4, 4]
    # a step whose cost is all per token: a draft token costs what the
    # request's own token costs, so only certain ones could pay, and none gain
    assert choose_draft_lengths([np.array([0.9, 0.8])], 1, 0, 0.0, 1.0) == [0]
    # between: the likely head of a chain pays, its unlikely tail does not
    assert choose_draft_lengths([np.array([0.9, 0.5, 0.05])], 1, 0, 1.0, 0.1) == [2]


def test_acceptance_estimator_counts_conditional_rates():
    est = AcceptanceEstimator(4, request_decay=1.0, prior_weight=1e-9, global_decay=1.0)
    for _ in range(10):
        est.observe("a", 4, 4)       # all four accepted
        est.observe("b", 4, 1)       # first accepted, second rejected
    assert est.rates("a") == pytest.approx([1, 1, 1, 1], abs=1e-6)
    np.testing.assert_allclose(est.rates("b")[:2], [1, 0], atol=1e-6)
    # b never reached positions 2-3: its rate there is the engine-wide one
    np.testing.assert_allclose(est.rates("b")[2:], est.global_rates()[2:])
    assert list(est.survival("b", 3)) == pytest.approx([1, 0, 0], abs=1e-6)
    est.forget("a")
    np.testing.assert_allclose(est.rates("a"), est.global_rates())


def test_acceptance_estimator_follows_a_request_whose_acceptance_changes():
    est = AcceptanceEstimator(3)
    for _ in range(20):
        est.observe("r", 3, 3)
    high = est.survival("r", 3)[-1]
    for _ in range(5):
        est.observe("r", 3, 0)
    # five rejections in a row take it below a coin flip, against the
    # engine-wide rate (0.8 here) it is shrunk toward
    assert high > 0.8 and est.survival("r", 3)[0] < 0.5


def test_cost_model_recovers_a_noisy_line_and_skips_idle_gaps():
    rng = np.random.default_rng(0)
    model = StepCostModel()
    for _ in range(400):
        tokens = int(rng.integers(8, 64))
        model.observe(tokens, 0.004 + 0.0002 * tokens + rng.normal(0, 1e-5))
    fixed, per_token = model.coefficients()
    assert fixed == pytest.approx(0.004, rel=0.05)
    assert per_token == pytest.approx(0.0002, rel=0.05)
    assert not model.observe(32, 1.0)  # the engine waited for requests
    assert model.num_outliers == 1


def test_cost_model_stays_defined_without_spread():
    model = StepCostModel()
    for _ in range(5000):
        model.observe(16, 0.01)
    fixed, per_token = model.coefficients()
    assert np.isfinite([fixed, per_token]).all() and per_token > 0
    assert model.predict(16) == pytest.approx(0.01, rel=1e-3)


def test_cost_model_follows_a_change_of_regime():
    model = StepCostModel()
    rng = np.random.default_rng(2)
    for slope in (0.0001, 0.001):   # the batch grew into the compute-bound range
        for _ in range(300):
            tokens = int(rng.integers(16, 96))
            model.observe(tokens, 0.002 + slope * tokens)
    assert model.coefficients()[1] == pytest.approx(0.001, rel=0.05)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulate(controller, clock, fixed, per_token, accept_rate, steps=200, num_reqs=4,
              k=4, seed=0):
    """Steps of a fake engine with an affine step cost and i.i.d. acceptance;
    the mean kept draft length over the second half (after the warm-up)."""
    rng = np.random.default_rng(seed)
    req_ids = [f"r{i}" for i in range(num_reqs)]
    kept_total = 0
    for step in range(steps):
        kept = _step(controller, clock, req_ids, k, fixed, per_token, accept_rate, rng)
        kept_total += kept if step >= steps // 2 else 0
    return kept_total / ((steps - steps // 2) * num_reqs)


def _step(controller, clock, req_ids, k, fixed, per_token, accept_rate, rng) -> int:
    """One step of the fake engine: drafts of k tokens trimmed, the affine
    cost paid, each kept token accepted with `accept_rate` until the first
    rejection; returns the draft tokens kept."""
    drafts = controller.trim(req_ids, [list(range(k)) for _ in req_ids], len(req_ids))
    num_tokens = len(req_ids) + sum(map(len, drafts))
    clock.now += fixed + per_token * num_tokens
    controller.step_done(num_tokens)
    for req_id, draft in zip(req_ids, drafts):
        accepted = 0
        while accepted < len(draft) and rng.random() < accept_rate:
            accepted += 1
        controller.verified(req_id, accepted + 1)
    return num_tokens - len(req_ids)


def test_controller_speculates_where_it_pays_and_stops_where_it_does_not():
    clock = _Clock()
    cheap = AdaptiveController(4, clock=clock)
    assert _simulate(cheap, clock, fixed=0.01, per_token=1e-5, accept_rate=0.8) > 3.5
    clock = _Clock()
    costly = AdaptiveController(4, clock=clock)
    kept = _simulate(costly, clock, fixed=1e-4, per_token=1e-3, accept_rate=0.5)
    assert kept < 0.2
    assert costly.stats.num_probes > 0  # its estimates are kept current


def test_proposer_state_survives_steps_with_no_drafts():
    """Drafts cut to nothing must not change what the proposer drafts later
    (TensorRT-LLM #16888: acceptance collapsed after K=0 steps): the same
    history gives the same draft whether or not earlier drafts were cut."""
    rng = np.random.default_rng(1)
    text = np.tile(rng.integers(0, 50, size=12), 12).astype(np.int32)
    for method in ("specplug_ngram", "specplug_suffix", "specplug_hybrid"):
        # 29: a length both runs reach, so that they step in line after it
        seen = [_drafts_by_length(method, text, cut_until=cut) for cut in (0, 29)]
        shared = set(seen[0]) & set(seen[1])
        assert len([n for n in shared if n > 29]) >= 5   # compared after the cut, too
        assert all(seen[0][n] == seen[1][n] for n in shared), method
        assert any(seen[1][n] for n in shared if n > 29), method  # and it drafts


def _drafts_by_length(method: str, text: np.ndarray, cut_until: int) -> dict[int, list[int]]:
    """Feed `text` through a proposer as an engine would (verification
    against `text` itself); drafts are cut to nothing while the history is
    shorter than `cut_until`. Returns {history length: draft}."""
    from vllm_specplug.proposers.base import ProposeBatch, ProposerContext
    from vllm_specplug.registry import get_proposer_class, parse_options

    context = ProposerContext(num_speculative_tokens=4, max_model_len=256, vocab_size=64,
                              device="cpu")
    options = {"proposers": [{"method": "specplug_suffix"}, {"method": "specplug_ngram"}]} \
        if method == "specplug_hybrid" else {}
    proposer = get_proposer_class(method)(parse_options(method, options), context)
    num = 8
    proposer.start_request("r", text[:num].copy())
    out = {}
    while num < len(text) - 5:
        batch = ProposeBatch(["r"], text[None, :num], np.array([num]), 4)
        draft = list(proposer.propose(batch)[0])
        out[num] = draft
        if num < cut_until:
            draft = []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == text[num + accepted]:
            accepted += 1
        new = text[num:num + accepted + 1].tolist()
        proposer.update_request("r", new)
        num += len(new)
    return out


def test_v2_adapts_only_where_a_cut_saves_slots():
    """Under vLLM's AsyncScheduler every request keeps K slots: a cut draft
    token would be padded and verified anyway, so "auto" leaves drafts whole
    there; sync scheduling and SpecplugAsyncScheduler size steps by length."""
    from types import SimpleNamespace

    from vllm_specplug.integration.scheduler import SpecplugAsyncScheduler
    from vllm_specplug.integration.v2.speculator import lengths_reach_scheduler

    def config(async_scheduling, cls):
        return SimpleNamespace(async_scheduling=async_scheduling, scheduler_cls=cls)

    assert not lengths_reach_scheduler(config(True, None))
    assert lengths_reach_scheduler(config(False, None))
    assert lengths_reach_scheduler(config(True, SpecplugAsyncScheduler))
    assert lengths_reach_scheduler(
        config(True, "vllm_specplug.integration.scheduler.SpecplugAsyncScheduler"))
    assert not lengths_reach_scheduler(config(True, "my.pkg.OtherScheduler"))


def _simulate_short_requests(controller, clock, phases, lifetime=20, num_reqs=4, k=4,
                             fixed=0.01, per_token=1e-3, seed=0):
    """A fake engine whose requests live `lifetime` steps (shorter than the
    per-request probe interval), through phases of (steps, acceptance
    rate); the mean kept draft length over the last phase's second half."""
    rng = np.random.default_rng(seed)
    step, kept_total, counted = 0, 0, 0
    for phase, (num_steps, accept_rate) in enumerate(phases):
        for i in range(num_steps):
            req_ids = [f"r{(step + j * lifetime // num_reqs) // lifetime}-{j}"
                       for j in range(num_reqs)]
            kept = _step(controller, clock, req_ids, k, fixed, per_token, accept_rate, rng)
            if phase == len(phases) - 1 and i >= num_steps // 2:
                kept_total += kept
                counted += num_reqs
            step += 1
    return kept_total / counted


def test_short_requests_still_explore_after_every_draft_was_cut():
    """Requests that never live long enough for their own probe: once
    acceptance was low and every draft is cut, only the engine-wide probe
    finds that acceptance has risen (without it, nothing is ever verified
    again: the K=0 trap at the engine's level). The step cost is pinned to
    the simulated line, so only acceptance is learned."""
    phases = [(120, 0.05), (400, 0.95)]
    clock = _Clock()
    exploring = AdaptiveController(4, clock=clock)
    exploring.cost.pinned = (0.01, 1e-3)
    assert _simulate_short_requests(exploring, clock, phases) > 2.0
    assert exploring.stats.num_global_probes > 0
    clock = _Clock()
    stuck = AdaptiveController(4, global_probe_interval=None, clock=clock)
    stuck.cost.pinned = (0.01, 1e-3)
    assert _simulate_short_requests(stuck, clock, phases) == 0.0
    assert stuck.stats.num_probes == 0 and stuck.stats.num_global_probes == 0


def _simulate_confidences(controller, clock, fixed, per_token, steps=300, num_reqs=8, k=4,
                          seed=0, give_confidences=True):
    """Fresh requests every step (no history to learn from), half of them
    drafting tokens the proposer is sure of (accepted 90% of the time), half
    guesses (10%). Mean kept draft length of each kind over the second half."""
    rng = np.random.default_rng(seed)
    kept = {0.9: [], 0.1: []}
    for step in range(steps):
        req_ids = [f"s{step}-{i}" for i in range(num_reqs)]
        rates = [0.9 if i % 2 else 0.1 for i in range(num_reqs)]
        confidences = [[r] * k for r in rates] if give_confidences else None
        drafts = controller.trim(req_ids, [list(range(k)) for _ in req_ids], num_reqs,
                                 confidences)
        num_tokens = num_reqs + sum(map(len, drafts))
        clock.now += fixed + per_token * num_tokens
        controller.step_done(num_tokens)
        for req_id, draft, rate in zip(req_ids, drafts, rates):
            accepted = 0
            while accepted < len(draft) and rng.random() < rate:
                accepted += 1
            controller.verified(req_id, accepted + 1)
            controller.forget(req_id)
            if step >= steps // 2:
                kept[rate].append(len(draft))
    return {rate: float(np.mean(lengths)) for rate, lengths in kept.items()}


def test_proposer_confidences_tell_sure_drafts_from_guesses():
    """A proposer's per-token confidence, calibrated against what is
    accepted, lets the controller keep sure drafts and cut guesses for
    requests with no history; without it both get the same length."""
    cost = dict(fixed=1e-3, per_token=2e-4)
    clock = _Clock()
    informed = AdaptiveController(4, clock=clock)
    with_confidences = _simulate_confidences(informed, clock, **cost)
    assert with_confidences[0.9] > 3.0 and with_confidences[0.1] < 0.5, with_confidences
    rates = informed.as_dict()["confidence_acceptance"]
    # calibrated toward 10% and 90% (guesses, mostly cut, are seen less often)
    assert rates[0] < 0.4 and rates[3] > 0.8, rates
    clock = _Clock()
    blind = _simulate_confidences(AdaptiveController(4, clock=clock), clock, **cost,
                                  give_confidences=False)
    assert abs(blind[0.9] - blind[0.1]) < 0.5, blind
