"""Our proposers in a real engine: greedy output equals no speculation token
for token, on single prompts, batches and the edge cases of a request's life."""
from __future__ import annotations

import re

import pytest

from vllm_specplug.testing.compare import (assert_abort_leaves_others_exact,
                                           assert_same_tokens, assert_stopping_matches)
from vllm_specplug.testing.engine import (generate, generate_each,
                                          greedy_params)
from vllm_specplug.testing.metrics import read_spec_decode_counts
from vllm_specplug.testing.constraints import OUTPUT_PATTERNS, constraint

from tests.conftest import MAX_NEW_TOKENS, NUM_SINGLE_PROMPTS, speculative_engines

CONFIGS = {
    "specplug_ngram": {"method": "specplug_ngram", "num_speculative_tokens": 4,
                       "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "specplug_suffix": {"method": "specplug_suffix", "num_speculative_tokens": 6,
                        "min_token_prob": 0.1},
    "specplug_hybrid": {"method": "specplug_hybrid", "num_speculative_tokens": 6,
                        "proposers": [{"method": "specplug_suffix", "min_token_prob": 0.3},
                                      {"method": "specplug_ngram", "prompt_lookup_max": 3}]},
}
REPETITIVE = "".join(f"def get_{n}(self):\n    return self._{n}\n\n"
                     for n in ("name", "value", "size", "mode", "path", "data"))


spec_llm = speculative_engines(CONFIGS)


def test_single_prompts_equal_no_speculation(spec_llm, eval_prompts, baseline_outputs):
    params = greedy_params(MAX_NEW_TOKENS)
    prompts = eval_prompts[:NUM_SINGLE_PROMPTS]
    ours = generate_each(spec_llm, prompts, params)
    assert_same_tokens(baseline_outputs["single"], ours, prompts)


def test_batch_equals_no_speculation_and_speculates(spec_llm, eval_prompts,
                                                    baseline_outputs):
    before = read_spec_decode_counts(spec_llm)
    ours = generate(spec_llm, eval_prompts, greedy_params(MAX_NEW_TOKENS)).token_ids
    counts = read_spec_decode_counts(spec_llm) - before
    assert_same_tokens(baseline_outputs["batched"], ours, eval_prompts)
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0


@pytest.mark.parametrize("make_params", [
    lambda base: greedy_params(1),
    lambda base: greedy_params(MAX_NEW_TOKENS, stop=["return"]),
    lambda base: greedy_params(MAX_NEW_TOKENS, stop_token_ids=[base[12]]),  # EOS-like stop
    lambda base: greedy_params(MAX_NEW_TOKENS, stop=["\n\n"], include_stop_str_in_output=True),
], ids=["max_tokens_1", "stop_string", "stop_token", "stop_string_kept"])
def test_stopping_requests_equal_no_speculation(spec_llm, baseline_llm, make_params):
    prompts = [REPETITIVE, REPETITIVE[:120]]
    base_ids = generate(baseline_llm, prompts[:1], greedy_params(MAX_NEW_TOKENS)).token_ids[0]
    assert_stopping_matches(spec_llm, baseline_llm, prompts, make_params(base_ids))


def _adaptive(llm) -> dict:
    return llm.collective_rpc("specplug_adaptive_stats")[0]


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("num_offered", "num_kept", "num_probes",
                                               "num_global_probe_tokens",
                                               "num_verified_drafts", "num_accepted")}


def test_adaptive_controller_cuts_drafts_where_they_do_not_pay_and_stays_exact(
        spec_llm, eval_prompts, baseline_outputs):
    """On by default; with a step cost that is all per token (no draft can
    pay) it verifies only its probes (per request, and engine-wide after
    steps with nothing kept), with a cost that is all fixed every draft;
    outputs equal no speculation's either way (issue 27)."""
    assert _adaptive(spec_llm) is not None, "adaptive draft lengths are on by default"
    try:
        cuts = {}
        for name, (fixed_ms, per_token_ms) in {"none_pay": (0.0, 1.0),
                                               "all_pay": (1000.0, 1e-6)}.items():
            spec_llm.collective_rpc("specplug_adaptive_pin", args=(fixed_ms, per_token_ms))
            before = _adaptive(spec_llm)
            ours = generate(spec_llm, eval_prompts, greedy_params(MAX_NEW_TOKENS)).token_ids
            assert_same_tokens(baseline_outputs["batched"], ours, eval_prompts)
            cuts[name] = _delta(_adaptive(spec_llm), before)
    finally:
        spec_llm.collective_rpc("specplug_adaptive_pin", args=(None,))
    assert cuts["none_pay"]["num_offered"] > 0
    none_pay = cuts["none_pay"]
    assert none_pay["num_kept"] == (none_pay["num_probes"]
                                    + none_pay["num_global_probe_tokens"])
    assert cuts["all_pay"]["num_kept"] == cuts["all_pay"]["num_offered"] > 0
    # the controller hears how its drafts fared (its acceptance estimates),
    # calibrating the proposer's per-token confidences against it
    assert cuts["all_pay"]["num_verified_drafts"] > 0 and cuts["all_pay"]["num_accepted"] > 0
    assert sum(_adaptive(spec_llm)["confidence_tokens"]) > 0


def test_abort_mid_generation_leaves_others_exact(spec_llm, baseline_llm, eval_prompts):
    assert_abort_leaves_others_exact(spec_llm, baseline_llm, eval_prompts[:4],
                                     greedy_params(MAX_NEW_TOKENS))


KINDS = ["json", "regex", "choice", "grammar", None]


def test_constrained_requests_in_one_batch_equal_no_speculation(spec_llm, baseline_llm,
                                                                  eval_prompts):
    """A JSON schema, a regex, a choice, an EBNF grammar and no constraint,
    in turn over one batch (issue 30): every output equals no
    speculation's, and each holds its constraint. vLLM's scheduler cuts each
    draft at its first token the grammar forbids."""
    prompts = eval_prompts[:10]
    kinds = [KINDS[i % len(KINDS)] for i in range(len(prompts))]
    params = [greedy_params(32, structured_outputs=constraint(kind) if kind else None)
              for kind in kinds]
    expected = generate(baseline_llm, prompts, params)
    ours = generate(spec_llm, prompts, params)
    assert_same_tokens(expected.token_ids, ours.token_ids, prompts)
    for kind, text in zip(kinds, ours.texts):
        if kind == "json":
            assert text.lstrip().startswith("{"), text
        elif kind is not None:
            assert re.fullmatch(OUTPUT_PATTERNS[kind], text), (kind, text)
