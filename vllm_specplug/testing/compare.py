"""Exact token-for-token comparison of two engines' outputs, for tests."""
from __future__ import annotations

from vllm_specplug.bench.compare import first_divergence, token_mismatches  # noqa: F401


def assert_same_tokens(expected, actual, prompts=None) -> None:
    mismatches = token_mismatches(expected, actual, prompts)
    assert not mismatches, "speculative output differs:\n" + "\n".join(mismatches)


def assert_abort_leaves_others_exact(spec_llm, baseline_llm, prompts, params) -> None:
    """Abort request 1 after 3 steps: the others equal no speculation, the
    aborted one is a prefix of its full output."""
    from vllm_specplug.testing.engine import generate, generate_with_abort

    expected = generate(baseline_llm, prompts, params).token_ids
    produced = generate_with_abort(spec_llm, prompts, params, abort_index=1,
                                   abort_after_steps=3)
    for i in range(len(prompts)):
        if i != 1:
            assert produced[str(i)] == expected[i]
    aborted = produced["1"]
    assert len(aborted) < len(expected[1]) and aborted == expected[1][:len(aborted)]


def assert_stopping_matches(spec_llm, baseline_llm, prompts, params) -> None:
    """Same token ids and texts as no speculation (stop strings, stop ids,
    max_tokens)."""
    from vllm_specplug.testing.engine import generate

    expected = generate(baseline_llm, prompts, params)
    ours = generate(spec_llm, prompts, params)
    assert_same_tokens(expected.token_ids, ours.token_ids, prompts)
    assert ours.texts == expected.texts
