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


# A greedy choice whose top-2 log-probabilities differ by less than this is a
# tie within floating-point noise: a different batch shape (kernels pick other
# tile sizes and reduction orders) may flip it with or without speculation.
NEAR_TIE_GAP = 1e-3


def top2_gaps(outputs) -> list[list[float]]:
    """Per request, per generated token: log p(top-1) - log p(top-2), from
    vLLM `RequestOutput`s generated greedily with `logprobs=2`."""
    gaps = []
    for output in outputs:
        per_token = []
        for position in output.outputs[0].logprobs or []:
            values = sorted((lp.logprob for lp in position.values()), reverse=True)
            per_token.append(values[0] - values[1] if len(values) > 1 else float("inf"))
        gaps.append(per_token)
    return gaps


def divergences(expected: list[list[int]], actual: list[list[int]],
                gaps: list[list[float]]) -> list[dict]:
    """One entry per request whose tokens differ: where they first differ and
    the expected run's top-2 gap there (a gap under NEAR_TIE_GAP: a flip of a
    floating-point tie; larger: a real difference)."""
    found = []
    for i, (exp, act) in enumerate(zip(expected, actual)):
        at = first_divergence(exp, act)
        if at is not None:
            gap = gaps[i][at] if at < len(gaps[i]) else float("inf")
            found.append({"request": i, "position": at, "gap": gap})
    return found
