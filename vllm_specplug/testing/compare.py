"""Exact token-for-token comparison of two engines' outputs."""
from __future__ import annotations


def first_divergence(expected: list[int], actual: list[int]) -> int | None:
    """Index of the first differing token, or None when the lists are equal."""
    for i, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return i
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def token_mismatches(expected: list[list[int]], actual: list[list[int]],
                     prompts: list[str] | None = None) -> list[str]:
    """One readable line per request whose token ids differ."""
    if len(expected) != len(actual):
        return [f"{len(expected)} expected outputs but {len(actual)} actual"]
    lines = []
    for i, (exp, act) in enumerate(zip(expected, actual)):
        at = first_divergence(exp, act)
        if at is not None:
            prompt = repr(prompts[i][:40]) if prompts else ""
            lines.append(f"request {i} {prompt}: first differs at token {at}: "
                         f"expected {exp[at:at + 5]} got {act[at:at + 5]} "
                         f"(lengths {len(exp)} vs {len(act)})")
    return lines


def assert_same_tokens(expected, actual, prompts=None) -> None:
    mismatches = token_mismatches(expected, actual, prompts)
    assert not mismatches, "speculative output differs:\n" + "\n".join(mismatches)
