"""vLLM's built-in model-free methods are lossless on our tiny model, and the
metrics helpers read their acceptance correctly.

This is the harness's own acceptance test: later proposers are held to the
same comparisons.
"""
from __future__ import annotations

from vllm_specplug.cli.demo import VLLM_SUFFIX
from vllm_specplug.testing.compare import assert_same_tokens
from vllm_specplug.testing.engine import generate, generate_each, greedy_params
from vllm_specplug.testing.metrics import read_spec_decode_counts

from tests.conftest import MAX_NEW_TOKENS, NUM_SINGLE_PROMPTS, speculative_engines

REPETITIVE_PROMPT = "".join(
    f"def get_{name}(self):\n    return self._{name}\n\n"
    for name in ("name", "value", "size", "mode", "path", "data"))


spec_llm = speculative_engines(
    {"vllm-suffix": VLLM_SUFFIX})


def test_single_prompts_equal_no_speculation(spec_llm, eval_prompts, baseline_outputs):
    params = greedy_params(MAX_NEW_TOKENS)
    prompts = eval_prompts[:NUM_SINGLE_PROMPTS]
    ours = generate_each(spec_llm, prompts, params)
    assert_same_tokens(baseline_outputs["single"], ours, prompts)


def test_batch_equals_no_speculation(spec_llm, eval_prompts, baseline_outputs):
    ours = generate(spec_llm, eval_prompts, greedy_params(MAX_NEW_TOKENS)).token_ids
    assert_same_tokens(baseline_outputs["batched"], ours, eval_prompts)


def test_acceptance_counters_are_consistent(spec_llm, baseline_llm):
    params = greedy_params(MAX_NEW_TOKENS)
    before = read_spec_decode_counts(spec_llm)
    ours = generate(spec_llm, [REPETITIVE_PROMPT], params)
    counts = read_spec_decode_counts(spec_llm) - before
    assert_same_tokens(generate(baseline_llm, [REPETITIVE_PROMPT], params).token_ids,
                       ours.token_ids)
    assert counts.num_drafts > 0
    assert 0 < counts.num_accepted_tokens <= counts.num_draft_tokens
    assert sum(counts.accepted_per_pos) == counts.num_accepted_tokens
    # Chain verification: position i is accepted only after position i-1.
    per_pos = counts.accepted_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    # Each verify step emits 1 + accepted tokens; all output came from steps
    # (the first token comes from the prefill, not from a verify step).
    emitted = counts.num_drafts + counts.num_accepted_tokens
    assert emitted <= len(ours.token_ids[0])
    assert counts.mean_acceptance_length > 1.0
