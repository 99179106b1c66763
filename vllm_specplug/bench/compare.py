"""Exact token-for-token comparison of two runs' outputs: where each request
first differs, the baseline's top-2 gap there, and which differences count
as floating-point near-ties (`NEAR_TIE_GAP`, issue 26's one exception)."""
from __future__ import annotations

import math
import statistics


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
# Issue 26's number (its one allowed exception: "< 1e-4 in fp32"); 1e-3 until
# 2026-12-05.
NEAR_TIE_GAP = 1e-4


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


def sampled_divergences(expected: list[list[int]], actual: list[list[int]],
                        logprobs: list[list[dict[int, float]]], prompt_lens: list[int],
                        seed: int, temperature: float, top_p: float = 1.0) -> list[dict]:
    """Seeded sampling on Model Runner V2: one entry per request whose tokens
    differ, with the expected run's Gumbel-max gap between its token and the
    actual one where they first differ (`gumbel_noise.perturbed_gap`; under
    NEAR_TIE_GAP: a floating-point flip, as for greedy).

    `logprobs`: the expected run's raw log-probabilities per generated token
    (token id -> log p, vLLM's `logprobs=N`). The row drawing token i sits at
    position prompt_len - 1 + i. The gap is infinite where the actual token is
    not among them, or not provably inside the expected run's top-p nucleus
    (the mass above it over the listed tokens' mass, which bounds it, under
    `top_p`)."""
    from vllm_specplug.bench.gumbel_noise import perturbed_gap

    found = []
    for i, (exp, act) in enumerate(zip(expected, actual)):
        at = first_divergence(exp, act)
        if at is None:
            continue
        gap = float("inf")
        listed = logprobs[i][at] if at < min(len(exp), len(act)) else {}
        if exp[at] in listed and act[at] in listed:
            scaled = {t: lp / temperature for t, lp in listed.items()}
            top = max(scaled.values())
            mass = {t: math.exp(v - top) for t, v in scaled.items()}
            above = sum(m for t, m in mass.items() if scaled[t] > scaled[act[at]])
            if above / sum(mass.values()) < top_p:
                pos = prompt_lens[i] - 1 + at
                gap = perturbed_gap(seed, pos, temperature, (exp[at], listed[exp[at]]),
                                    (act[at], listed[act[at]]))
        found.append({"request": i, "position": at, "tokens": (exp[at:at + 1], act[at:at + 1]),
                      "gap": gap})
    return found


def format_divergences_table(rows) -> str:
    """Each greedy row's requests that differ from the baseline: where each
    first differs and the baseline's top-2 gap there (`-`: unknown), so a
    run tells a flip of a floating-point near-tie (gap under NEAR_TIE_GAP)
    from a real difference by how far; "" when no row differs."""
    shared = {True: ", vLLM's own differs there too", False: ", vLLM's own does not"}
    lines = [f"  {row.name} (batch {row.batch_size}{', ' + row.prompt_set if row.prompt_set else ''})"
             f": request {d['request']} at token {d['position']}, gap "
             f"{'-' if d['gap'] is None else format(d['gap'], '.2e')}"
             f"{shared.get(d.get('builtin_differs'), '')}"
             for row in rows if row.error is None for d in getattr(row, "divergences", [])]
    if not lines:
        return ""
    return "\n".join([f"first differences from the baseline (a near-tie: gap < {NEAR_TIE_GAP:g})"]
                     + lines)


def builtin_rows(specs) -> frozenset[str]:
    """The names of specs that run vLLM's own speculation (not ours, not
    none)."""
    return frozenset(s.name for s in specs if s.config is not None
                     and not str(s.config.get("method", "")).startswith("specplug"))


def compare_to_baseline(rows: list, baseline: str, greedy: bool,
                         builtin: frozenset[str] = frozenset()) -> None:
    """Each row's ratios over the baseline's repeats, and with greedy
    sampling its outputs against the baseline's (first repeats); rows or
    baselines not run yet (a run in progress) are left as they are.
    `builtin`: the names of rows that run vLLM's own speculation, whose
    differences vouch for ours (`_count_near_ties`)."""
    base = {(r.prompt_set, r.batch_size): r for r in rows
            if r.name == baseline and r.error is None and r.tokens_per_second}
    for row in rows:
        ref = base.get((row.prompt_set, row.batch_size))
        if row.error is not None or ref is None or not row.tokens_per_second:
            continue
        row.ratios = [ours / theirs for ours, theirs in
                      zip(row.tokens_per_second, ref.tokens_per_second)]
        row.speedup = statistics.median(row.ratios)
        if greedy:
            _record_divergences(row, ref)
    if greedy:
        _count_near_ties(rows, builtin)


def _record_divergences(row, ref) -> None:
    """Which of the row's requests differ from the baseline's, and where
    each first does, with the baseline's top-2 gap there (None: unknown;
    JSON has no infinity)."""
    row.num_mismatches = len(token_mismatches(ref.token_ids, row.token_ids))
    known = (bool(ref.top2_gaps) and len(ref.top2_gaps) == len(ref.token_ids)
             and len(ref.token_ids) == len(row.token_ids))
    found = divergences(ref.token_ids, row.token_ids,
                        ref.top2_gaps if known else [[] for _ in ref.token_ids])
    row.divergences = [{**d, "gap": d["gap"] if known and math.isfinite(d["gap"]) else None}
                       for d in found]
    row.num_near_ties = None if not known else 0


def _count_near_ties(rows: list, builtin: frozenset[str]) -> None:
    """A first difference is excused as a floating-point near-tie where the
    baseline's top-2 gap there is under NEAR_TIE_GAP and, for a row of ours
    beside rows of vLLM's own speculation at the same prompt set and batch
    size, one of those differs at the same request and token too (issue 26's
    one exception: "vLLM's own eagle3 diverges at the same place"). Each
    divergence of ours records that as `builtin_differs` (None: no such row
    ran)."""
    places = {}  # (prompt set, batch): the places where vLLM's own rows differ
    for row in rows:
        if row.name in builtin and row.num_near_ties is not None:
            places.setdefault((row.prompt_set, row.batch_size), set()).update(
                (d["request"], d["position"]) for d in row.divergences)
    for row in rows:
        if row.num_near_ties is None:  # not compared, or the baseline's gaps unknown
            continue
        theirs = None if row.name in builtin else places.get((row.prompt_set, row.batch_size))
        for d in row.divergences:
            if theirs is not None:
                d["builtin_differs"] = (d["request"], d["position"]) in theirs
        row.num_near_ties = sum(d["gap"] is not None and d["gap"] < NEAR_TIE_GAP
                                and d.get("builtin_differs", True) for d in row.divergences)
