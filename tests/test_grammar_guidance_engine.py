"""Trees under llguidance, the other backend vLLM picks for structured
outputs (`structured_outputs_config={"backend": "guidance"}`; under "auto"
vLLM falls back to it for what xgrammar cannot compile). One vLLM engine
holds one backend, and the drafter's grammars come from the same one: it
builds vLLM's own `StructuredOutputManager` in the worker
(integration/grammar_drafting.py). So a tree is drafted among the tokens
llguidance allows on each node's path, checked per node and masked on its
own path by the scheduler (integration/grammar_trees.py), and every output
equals no speculation's under the same backend, also when greedy trees are
decided from the target's choices (`grammar_verify: "choices"`). (xgrammar,
the default: tests/test_tree_eagle_engine.py.)
"""
from __future__ import annotations

import re

import pytest

from vllm_specplug.testing.compare import assert_same_tokens
from vllm_specplug.testing.constraints import OUTPUT_PATTERNS, constraint
from vllm_specplug.testing.engine import generate, greedy_params, running_llm
from vllm_specplug.testing.metrics import read_spec_decode_counts

from tests.test_tree_eagle_engine import TREES, tree_config

GUIDANCE = {"backend": "guidance"}
NUM_PROMPTS = 8
MAX_TOKENS = 48
# Tokens per decode step of tree 16 under llguidance, these 8 prompts, JSON
# on even requests and the regex on odd ones (2026-11-27, 251 tokens):
# drafting among the tokens the grammar allows 4.92 (51 steps); drafting the
# whole vocabulary (`grammar_drafts: false`, the scheduler pruning what the
# grammar forbids) 2.89 (87 steps). Above the bound: the drafter's grammars
# are llguidance's too, and they mask.
MIN_TOKENS_PER_STEP = 3.9


def _params(num_prompts: int) -> list:
    return [greedy_params(MAX_TOKENS, structured_outputs=constraint("regex" if i % 2 else "json"))
            for i in range(num_prompts)]


def _run(llm, prompts) -> tuple:
    before = read_spec_decode_counts(llm)
    outputs = generate(llm, prompts, _params(len(prompts)))
    return outputs, read_spec_decode_counts(llm) - before


@pytest.fixture(scope="module")
def under_guidance(tiny_model_dir, tiny_eagle3_dir, eval_prompts) -> dict:
    prompts = eval_prompts[:NUM_PROMPTS]
    with running_llm(tiny_model_dir, structured_outputs_config=GUIDANCE) as llm:
        expected, _ = _run(llm, prompts)
    tree = tree_config(tiny_eagle3_dir, *TREES["tree16_topk4"])
    with running_llm(tiny_model_dir, tree, structured_outputs_config=GUIDANCE) as llm:
        ours, counts = _run(llm, prompts)
    with running_llm(tiny_model_dir, {**tree, "grammar_verify": "choices"},
                     structured_outputs_config=GUIDANCE) as llm:
        choices, _ = _run(llm, prompts)
    return {"prompts": prompts, "expected": expected, "ours": ours, "counts": counts,
            "choices": choices}


def test_trees_under_llguidance_equal_no_speculation_and_draft_what_it_allows(under_guidance):
    prompts, expected, ours = (under_guidance[k] for k in ("prompts", "expected", "ours"))
    assert_same_tokens(expected.token_ids, ours.token_ids, prompts)
    assert all(text.lstrip().startswith("{") for text in ours.texts[0::2]), ours.texts[0::2]
    assert all(re.fullmatch(OUTPUT_PATTERNS["regex"], text) for text in ours.texts[1::2]), \
        ours.texts[1::2]
    steps = ours.num_output_tokens - under_guidance["counts"].num_accepted_tokens
    assert ours.num_output_tokens / steps > MIN_TOKENS_PER_STEP


def test_trees_decided_from_the_targets_choices_under_llguidance_equal_no_speculation(
        under_guidance):
    """`grammar_verify: "choices"` (integration/v1/tree_choices.py): the
    worker's grammar checks and rows are llguidance's too."""
    prompts, expected, choices = (under_guidance[k] for k in ("prompts", "expected", "choices"))
    assert_same_tokens(expected.token_ids, choices.token_ids, prompts)
