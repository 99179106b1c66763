"""Exact token-for-token comparison of two runs' outputs."""
from __future__ import annotations


def first_divergence(expected: list[int], actual: list[int]) -> int | None:
    """Index of the first differing token, or None when the lists are equal."""
    for i, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return i
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def token_mismatches(expected: list[list], actual: list[list],
                     prompts: list[str] | None = None) -> list[str]:
    """One readable line per request whose outputs differ (token ids, or any
    other per-request sequence such as streamed text)."""
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
