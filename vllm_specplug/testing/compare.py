"""Exact token-for-token comparison of two engines' outputs, for tests."""
from __future__ import annotations

from vllm_specplug.bench.compare import first_divergence, token_mismatches  # noqa: F401


def assert_same_tokens(expected, actual, prompts=None) -> None:
    mismatches = token_mismatches(expected, actual, prompts)
    assert not mismatches, "speculative output differs:\n" + "\n".join(mismatches)
