"""The tree budget (`"adaptive": true` for `specplug_eagle3`, issue 27) in a
real engine (V1 runner, CPU): exact whatever it decides, drafting skipped
where the step cost says it does not pay, and after steps without drafts
the head drafts as well as before (TensorRT-LLM #16888: acceptance silently
collapsed after K = 0 steps, the drafter's state out of step).

The step-cost line is pinned through the worker probe
(`specplug_adaptive_pin`), so each phase's decision does not depend on this
machine's speed: "costly" makes every verified token cost a second,
"cheap" makes the step's fixed part dominate.
"""
from __future__ import annotations

import pytest

from vllm_specplug.testing.compare import assert_same_tokens
from vllm_specplug.testing.engine import (generate_in_phases, greedy_params, make_llm,
                                          shutdown_llm)
from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

from tests.conftest import MAX_NEW_TOKENS
from tests.test_tree_eagle_engine import TREES, tree_config

COSTLY = (0.0, 1000.0)   # (fixed ms, ms per verified token): no draft pays
CHEAP = (1000.0, 1e-6)   # every node pays
NUM_COSTLY_STEPS = 24    # steps with the drafting pass skipped (but for probes)


@pytest.fixture(scope="module")
def budget_llm(tiny_model_dir, tiny_eagle3_dir):
    config = {**tree_config(tiny_eagle3_dir, *TREES["tree16_topk4"]), "adaptive": True}
    llm = make_llm(tiny_model_dir, config, worker_extension_cls=PROBE_QUALNAME)
    yield llm
    shutdown_llm(llm)


def _phased(llm, prompts, phases: list[tuple[int | None, tuple[float, float]]]):
    """Generate `prompts` stepping the engine by hand; each phase pins the
    cost line for its number of steps (None: to the end). Returns the token
    ids per prompt and the speculative counts of each phase."""
    def pin(line: tuple[float, float]) -> None:
        llm.collective_rpc("specplug_adaptive_pin", args=line)

    token_ids, counts = generate_in_phases(llm, prompts, greedy_params(MAX_NEW_TOKENS),
                                           phases, pin)
    llm.collective_rpc("specplug_adaptive_pin", args=(None,))
    return token_ids, counts


def test_costly_steps_skip_drafting_and_stay_exact(budget_llm, eval_prompts, baseline_outputs):
    before = budget_llm.collective_rpc("specplug_adaptive_stats")[0]
    token_ids, (counts,) = _phased(budget_llm, eval_prompts, [(None, COSTLY)])
    after = budget_llm.collective_rpc("specplug_adaptive_stats")[0]
    assert_same_tokens(baseline_outputs["batched"], token_ids, eval_prompts)
    skipped = after["num_skipped"] - before["num_skipped"]
    steps = after["num_steps"] - before["num_steps"]
    assert skipped > 0.7 * steps, (skipped, steps)
    # a request that did not draft left its head ingest for later (or for
    # never: most ended without drafting again)
    assert after["num_deferred_rows"] > before["num_deferred_rows"]
    assert after["num_dropped_rows"] > before["num_dropped_rows"]
    # the probes drafted whole trees now and then, for single requests
    assert after["num_probes"] > before["num_probes"] and counts.num_drafts > 0


def test_drafting_after_skipped_steps_accepts_as_before(budget_llm, eval_prompts,
                                                        baseline_outputs):
    """The same prompts with every node kept from the first step (the
    configured tree: "cheap" keeps them all), then with NUM_COSTLY_STEPS
    skipped steps first: outputs exact, and the drafts after the skipped
    steps accepted as well as the whole run's. During the skipped steps the
    head's ingest is deferred (integration/v1/deferred_ingest.py): the
    drafts after them come from a head that took those rows in one pass,
    and would be accepted less if it had missed or misplaced any."""
    whole, (reference,) = _phased(budget_llm, eval_prompts, [(None, CHEAP)])
    assert_same_tokens(baseline_outputs["batched"], whole, eval_prompts)
    stats = budget_llm.collective_rpc("specplug_adaptive_stats")[0]
    token_ids, (_, resumed) = _phased(budget_llm, eval_prompts,
                                      [(NUM_COSTLY_STEPS, COSTLY), (None, CHEAP)])
    assert_same_tokens(baseline_outputs["batched"], token_ids, eval_prompts)
    assert reference.num_drafts > 0 and resumed.num_drafts > 0
    assert resumed.mean_acceptance_length >= 0.85 * reference.mean_acceptance_length, (
        resumed.mean_acceptance_length, reference.mean_acceptance_length, stats)
