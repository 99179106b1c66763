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
decided, and after K = 0 steps the drafts must be accepted as before
(TensorRT-LLM #16888: acceptance silently collapsed after K = 0 steps).
"""
from __future__ import annotations

import pytest

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength
from vllm_specplug.testing.compare import assert_same_tokens
from vllm_specplug.testing.engine import greedy_params, make_llm, shutdown_llm
from vllm_specplug.testing.metrics import read_spec_decode_counts

from tests.conftest import MAX_NEW_TOKENS
from tests.test_tree_eagle_engine import TREES, tree_config

COSTLY = (0.0, 1.0)   # (fixed s, s per verified token)
CHEAP = (1.0, 1e-9)
NUM_COSTLY_STEPS = 24
CONFIGS = {  # None: the tree
    "tree16": None,
    "suffix": {"method": "specplug_suffix", "num_speculative_tokens": 5},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def batch_llm(request, tiny_model_dir, tiny_eagle3_dir):
    config = CONFIGS[request.param] or tree_config(tiny_eagle3_dir, *TREES["tree16_topk4"])
    llm = make_llm(tiny_model_dir, {**config, "adaptive": "batch"})
    cls = type(_scheduler(llm)).__name__
    assert cls == ("SpecplugBatchDraftTreeScheduler" if request.param == "tree16"
                   else "SpecplugBatchDraftScheduler"), cls
    yield llm
    shutdown_llm(llm)


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
    engine, policy = llm.llm_engine, _fresh_policy(llm, candidates)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy_params(MAX_NEW_TOKENS))
    produced = {str(i): [] for i in range(len(prompts))}
    counts = []
    for num_steps, line in phases:
        _pin(policy, line)
        before, steps = read_spec_decode_counts(llm), 0
        while engine.has_unfinished_requests() and (num_steps is None or steps < num_steps):
            for output in engine.step():
                produced[output.request_id] = list(output.outputs[0].token_ids)
            steps += 1
        counts.append(read_spec_decode_counts(llm) - before)
    return [produced[str(i)] for i in range(len(prompts))], counts, policy


def test_costly_steps_draft_nothing_and_stay_exact(batch_llm, eval_prompts, baseline_outputs):
    token_ids, (counts,), policy = _phased(batch_llm, eval_prompts, [(None, COSTLY)])
    assert_same_tokens(baseline_outputs["batched"], token_ids, eval_prompts)
    chosen = policy.as_dict()["chosen"]
    assert policy.current == 0 and chosen[0] > sum(chosen.values()) - chosen[0], chosen
    # the warm-up and explorations verified drafts now and then
    assert counts.num_drafts > 0


def test_drafts_after_steps_without_drafts_are_accepted_as_before(
        batch_llm, eval_prompts, baseline_outputs):
    """The longest draft from the first step, then the same prompts with
    NUM_COSTLY_STEPS steps at K = 0 first: exact, and the drafts after those
    steps accepted as well as the whole run's. The choice is between no
    draft and the longest, so that both runs draft alike once drafting."""
    longest = _scheduler(batch_llm).draft_length.candidates[-1]
    whole, (reference,), cheap = _phased(batch_llm, eval_prompts, [(None, CHEAP)],
                                         (0, longest))
    assert_same_tokens(baseline_outputs["batched"], whole, eval_prompts)
    assert cheap.current == longest, cheap.as_dict()
    token_ids, (_, resumed), policy = _phased(
        batch_llm, eval_prompts, [(NUM_COSTLY_STEPS, COSTLY), (None, CHEAP)], (0, longest))
    assert policy.lengths[0].num_chosen >= NUM_COSTLY_STEPS // 2, policy.as_dict()
    assert_same_tokens(baseline_outputs["batched"], token_ids, eval_prompts)
    assert reference.num_drafts > 0 and resumed.num_drafts > 0
    assert resumed.mean_acceptance_length >= 0.85 * reference.mean_acceptance_length, (
        resumed.mean_acceptance_length, reference.mean_acceptance_length)
