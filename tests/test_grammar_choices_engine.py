"""`grammar_verify: "choices"` (and "auto") in a real engine (the V1 runner on CPU):
greedy trees under a JSON schema, a regex, a choice and an EBNF grammar
left unmasked by the scheduler and decided from the target's choices in
the worker (integration/v1/tree_choices.py) give no speculation's tokens,
beside free and sampled requests, and with logprobs (the batch samples its
roots alone, their rows applied in the worker)."""
from __future__ import annotations

import re

import pytest
from vllm import SamplingParams

from vllm_specplug.testing.compare import assert_same_tokens
from vllm_specplug.testing.constraints import OUTPUT_PATTERNS, constraint
from vllm_specplug.testing.engine import generate, greedy_params, make_llm, shutdown_llm
from vllm_specplug.testing.metrics import read_spec_decode_counts
from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

from tests.conftest import MAX_NEW_TOKENS
from tests.test_tree_eagle_engine import TREES, tree_config


@pytest.fixture(scope="module")
def choices_llm(tiny_model_dir, tiny_eagle3_dir):
    spec = {**tree_config(tiny_eagle3_dir, *TREES["tree16_topk4"]), "grammar_verify": "choices"}
    llm = make_llm(tiny_model_dir, spec, worker_extension_cls=PROBE_QUALNAME)
    yield llm
    shutdown_llm(llm)


def _choice_counts(llm) -> list[int]:
    return llm.collective_rpc("specplug_grammar_choice_counts")[0]


def test_json_schema_trees_decided_from_the_targets_choices_equal_no_speculation(
        choices_llm, baseline_llm, eval_prompts):
    prompts = eval_prompts[:12]
    params = greedy_params(MAX_NEW_TOKENS, structured_outputs=constraint("json"))
    expected = generate(baseline_llm, prompts, params)
    before, counts_before = read_spec_decode_counts(choices_llm), _choice_counts(choices_llm)
    ours = generate(choices_llm, prompts, params)
    counts = read_spec_decode_counts(choices_llm) - before
    assert_same_tokens(expected.token_ids, ours.token_ids, prompts)
    assert counts.num_accepted_tokens > 0
    decided = [a - b for a, b in zip(_choice_counts(choices_llm), counts_before)]
    assert decided[0] > 0, decided  # trees decided so, not by rows


@pytest.mark.parametrize("kind", ["regex", "choice", "grammar"])
def test_constrained_free_and_sampled_requests_in_one_batch(choices_llm, baseline_llm,
                                                            eval_prompts, kind):
    """Every other request constrained and greedy, the others free: greedy
    ones and one seeded sample (its tree keeps the scheduler's rows)."""
    prompts = eval_prompts[:8]
    params = [greedy_params(32, structured_outputs=constraint(kind)) if i % 2 else
              SamplingParams(temperature=0.0, max_tokens=32) for i in range(len(prompts))]
    params[0] = SamplingParams(temperature=0.8, seed=3, max_tokens=32,
                               structured_outputs=constraint(kind))
    expected = generate(baseline_llm, prompts, params)
    ours = generate(choices_llm, prompts, params)
    assert_same_tokens(expected.token_ids[1:], ours.token_ids[1:], prompts[1:])
    constrained = [ours.texts[0]] + ours.texts[1::2]
    assert all(re.fullmatch(OUTPUT_PATTERNS[kind], text) for text in constrained), constrained


def test_roots_sampled_alone_keep_their_rows(choices_llm, baseline_llm, eval_prompts):
    """Logprobs send the batch to vLLM's sampler at each root: the chosen
    trees' roots get their rows in the worker, so the output is still no
    speculation's and holds the schema."""
    prompts = eval_prompts[:6]
    params = greedy_params(24, logprobs=1, structured_outputs=constraint("json"))
    expected = generate(baseline_llm, prompts, params)
    ours = generate(choices_llm, prompts, params)
    assert_same_tokens(expected.token_ids, ours.token_ids, prompts)


def test_auto_takes_the_choices_from_its_fewest_trees_on_and_keeps_its_own_grammars(
        tiny_model_dir, tiny_eagle3_dir, baseline_llm, eval_prompts):
    """`grammar_verify: "auto"` with `grammar_choices_min_trees` 4 and
    `grammar_drafts: false` (no drafter grammars to share: the choices
    compile and advance their own): a request alone keeps the scheduler's
    rows (no tree decided from the choices), a batch of 6 takes the choices
    while 4 of its trees are left; both give no speculation's tokens."""
    prompts = eval_prompts[:6]
    params = greedy_params(MAX_NEW_TOKENS, structured_outputs=constraint("json"))
    expected = generate(baseline_llm, prompts, params)
    spec = {**tree_config(tiny_eagle3_dir, *TREES["tree16_topk4"]), "grammar_verify": "auto",
            "grammar_choices_min_trees": 4, "grammar_drafts": False}
    llm = make_llm(tiny_model_dir, spec, worker_extension_cls=PROBE_QUALNAME)
    try:
        alone = generate(llm, prompts[:1], params)
        decided_alone = _choice_counts(llm)
        ours = generate(llm, prompts, params)
        decided = _choice_counts(llm)
    finally:
        shutdown_llm(llm)
    assert_same_tokens(expected.token_ids[:1], alone.token_ids, prompts[:1])
    assert_same_tokens(expected.token_ids, ours.token_ids, prompts)
    assert decided_alone[0] == 0, decided_alone  # one tree a step: every node's row
    assert decided[0] > 0, decided
