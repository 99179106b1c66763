"""One draft length (or tree size) per step for the whole batch
(integration/batch_schedule.py, issue 27) in a real engine on CPU: vLLM's sync
scheduler with our lookup in place of its dynamic table, the V1 runner.

Selected as a user does, with `"adaptive": "batch"` (on CUDA `"adaptive":
true` also selects it, under Model Runner V2: tests/test_model_runner_v2_unit.py
checks the config; GPU runs in docs/results/). The step costs are
pinned on the scheduler's own step times, so each phase's decision does not
depend on this machine's speed: "costly" makes every verified token cost a
second (no draft pays: K = 0), "cheap" makes the step's fixed part dominate
(the longest draft pays). Outputs must equal no speculation's whatever was
decided, and after K = 0 steps (where the head's ingest waits for the next
drafting step, deferred_ingest.py) the drafts must be accepted as before
(TensorRT-LLM #16888: acceptance silently collapsed after K = 0 steps).
"""
from __future__ import annotations

import pytest

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength
from vllm_specplug.testing.compare import assert_same_tokens
from vllm_specplug.testing.engine import (generate_in_phases, greedy_params, make_llm,
                                          shutdown_llm)

from tests.conftest import MAX_NEW_TOKENS
from tests.test_tree_eagle_engine import TREES, tree_config

COSTLY = (0.0, 1.0)   # (fixed s, s per verified token)
CHEAP = (1.0, 1e-9)
NUM_COSTLY_STEPS = 24
NUM_PROMPTS = 12  # of the eval prompts: CI time


@pytest.fixture(scope="module")
def batch_llm(tiny_model_dir, tiny_eagle3_dir):
    """A tree of the head: the drafter whose state must follow the steps
    without drafts (the model-free methods draft from the token history)."""
    config = tree_config(tiny_eagle3_dir, *TREES["tree16_topk4"])
    llm = make_llm(tiny_model_dir, {**config, "adaptive": "batch"})
    assert type(_scheduler(llm)).__name__ == "SpecplugBatchDraftTreeScheduler"
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="module")
def prompts(eval_prompts):
    return eval_prompts[:NUM_PROMPTS]


@pytest.fixture(scope="module")
def expected(baseline_outputs):
    return baseline_outputs["batched"][:NUM_PROMPTS]


def _scheduler(llm):
    """The engine core's scheduler (the core runs in this process in tests)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _fresh_policy(llm, candidates: tuple[int, ...] | None) -> BatchDraftLength:
    """A new policy exploring often, as the scheduler's lookup (by default
    over the scheduler's own candidates)."""
    scheduler = _scheduler(llm)
    policy = BatchDraftLength(candidates or scheduler.draft_length.candidates, explore_every=8)
    scheduler.draft_length = scheduler.dynamic_sd_lookup = policy
    return policy


def _pin(policy: BatchDraftLength, line: tuple[float, float]) -> None:
    policy.times.pinned = line


def _phased(llm, prompts, phases, candidates: tuple[int, ...] | None = None):
    """Generate `prompts` stepping the engine by hand, each phase with its
    step times pinned to a line for its number of steps (None: to the end).
    Returns the token ids per prompt, the speculative counts of each phase
    and the policy."""
    policy = _fresh_policy(llm, candidates)
    token_ids, counts = generate_in_phases(llm, prompts, greedy_params(MAX_NEW_TOKENS), phases,
                                           lambda line: _pin(policy, line))
    return token_ids, counts, policy


def _num_deferred_rows(llm) -> int:
    """Verified rows the head kept back so far (deferred_ingest.py)."""
    return llm.collective_rpc(
        lambda worker: worker.model_runner.drafter.deferred.num_deferred)[0]


def test_costly_steps_draft_nothing_and_stay_exact(batch_llm, prompts, expected):
    token_ids, (counts,), policy = _phased(batch_llm, prompts, [(None, COSTLY)])
    assert_same_tokens(expected, token_ids, prompts)
    chosen = policy.as_dict()["chosen"]
    assert policy.current == 0 and chosen[0] > sum(chosen.values()) - chosen[0], chosen
    # the warm-up and explorations verified drafts now and then
    assert counts.num_drafts > 0
    # the workers hold the policy's decisions as of the last step (what
    # `vllm-specplug bench` reports), though the scheduler runs elsewhere
    view = batch_llm.collective_rpc(lambda worker: worker.model_runner.drafter.batch_policy)[0]
    assert view["chosen"] == chosen and view["num_steps"] == policy.stats.num_steps, view


def test_a_trees_paths_teach_the_policy_every_smaller_size(batch_llm, prompts, expected):
    """Each tree step's accepted paths reach the policy (their nodes' ranks,
    on the runner's output: `TreeStep.path_ranks`), and the lengths below
    the one verified learn from them: on at least half of the steps the
    longest tree ran, and the smaller size's estimate stays at most the
    longest's."""
    longest = _scheduler(batch_llm).draft_length.candidates[-1]
    token_ids, _, policy = _phased(batch_llm, prompts, [(None, CHEAP)], (0, 4, longest))
    assert_same_tokens(expected, token_ids, prompts)
    chosen = policy.as_dict()["chosen"]
    assert policy.current == longest and policy.stats.num_path_steps >= chosen[longest] // 2, (
        policy.stats, chosen)
    assert 1.0 < policy.expected_tokens(4) <= policy.expected_tokens(longest)
    _assert_the_stat_logger_reads(batch_llm, policy)


def _assert_the_stat_logger_reads(llm, policy: BatchDraftLength) -> None:
    """What a server's `/metrics` shows of the policy (integration/stat_logger.py:
    `vllm serve` loads it, this offline engine does not, so it is made here on
    the engine's config): the sums the scheduler wrote to its channel at its
    last step (integration/policy_channel.py), exactly."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.stats import SchedulerStats

    from vllm_specplug.integration.stat_logger import SpecplugStatLogger

    config = llm.llm_engine.vllm_config
    SpecplugStatLogger(config, 0).record(SchedulerStats(), None)
    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}
    stats = policy.stats
    assert stats.num_requests > 0 and stats.realised_tokens >= stats.num_requests
    read = {name: REGISTRY.get_sample_value(name, labels) for name in (
        "specplug:expected_tokens_total", "specplug:realised_tokens_total",
        "specplug:observed_requests_total", "specplug:batch_draft_length")}
    assert read == {"specplug:expected_tokens_total": stats.expected_tokens,
                    "specplug:realised_tokens_total": stats.realised_tokens,
                    "specplug:observed_requests_total": stats.num_requests,
                    "specplug:batch_draft_length": policy.current}, read


def test_drafts_after_steps_without_drafts_are_accepted_as_before(batch_llm, prompts, expected):
    """The longest draft from the first step, then the same prompts with
    NUM_COSTLY_STEPS steps at K = 0 first: exact, and the drafts after those
    steps accepted as well as the whole run's. The choice is between no
    draft and the longest, so that both runs draft alike once drafting."""
    longest = _scheduler(batch_llm).draft_length.candidates[-1]
    whole, (reference,), cheap = _phased(batch_llm, prompts, [(None, CHEAP)], (0, longest))
    assert_same_tokens(expected, whole, prompts)
    assert cheap.current == longest, cheap.as_dict()
    deferred = _num_deferred_rows(batch_llm)
    token_ids, (_, resumed), policy = _phased(
        batch_llm, prompts, [(NUM_COSTLY_STEPS, COSTLY), (None, CHEAP)], (0, longest))
    assert policy.lengths[0].num_chosen >= NUM_COSTLY_STEPS // 2, policy.as_dict()
    # at K = 0 the head's ingest waited for the next drafting step
    assert _num_deferred_rows(batch_llm) > deferred
    assert_same_tokens(expected, token_ids, prompts)
    assert reference.num_drafts > 0 and resumed.num_drafts > 0
    assert resumed.mean_acceptance_length >= 0.85 * reference.mean_acceptance_length, (
        resumed.mean_acceptance_length, reference.mean_acceptance_length)
