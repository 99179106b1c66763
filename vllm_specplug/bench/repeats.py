"""Each measured repeat of a `bench offline` row on its own: acceptance,
the engine's prefix-cache hits and our head's prefix hits.

Under greedy sampling a row's repeats generate the same tokens, so a method
whose drafting depends only on them accepts the same in every repeat. On the
H200 (SmolLM2, MT-Bench, 2026-12-04) vLLM's `eagle3` took 1110 steps in each
repeat and our chain a varying number, 4% more on average (issue 26): what
differs between repeats is the state an engine carries over, above all its
prefix cache (which blocks are still cached, and for our head, which of
them it saved rows for: a hit with a block unsaved is "missed", and
"filled" where the rows came from a request running beside it, else that
request drafts from its uncached suffix alone). These per-repeat records
say whether a row's acceptance moved with them. Each also keeps its decode
time (`decode_ms`: its waves' first token to last, engine timestamps;
bench/waves.py), which `bench ratios --decode` compares repeat by repeat.

vLLM's τ (`accept len`) counts only steps that drafted: under a grammar
its scheduler keeps the valid prefix of each draft, and a step whose
draft was cut to nothing is no draft. Each repeat therefore also gets
`tokens_per_step`: the tokens each request decoded after its first, over
every step they took. A step with a draft yields 1 + its accepted
tokens, a step without yields 1, so the steps without a draft are those
tokens less the drafting steps' (docs/results/grammar_large_head_cpu).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_specplug.metrics import SpecDecodeCounts, read_engine_metrics, read_spec_decode_counts

PREFIX_QUERIES = "vllm:prefix_cache_queries"  # prompt tokens looked up (a counter)
PREFIX_HITS = "vllm:prefix_cache_hits"  # of those, found cached
GENERATION_TOKENS = "vllm:generation_tokens"  # tokens generated, each request's first included
REQUESTS_DONE = "vllm:request_success"  # requests finished (one counter per finish reason)
COUNTERS = (PREFIX_QUERIES, PREFIX_HITS, GENERATION_TOKENS, REQUESTS_DONE)


@dataclass
class RepeatState:
    """An engine's cumulative counters at one moment."""

    counts: SpecDecodeCounts
    prefix_queries: int
    prefix_hits: int
    # our head's counters: prefix hits {"adopted", "missed",
    # "missed_positions", "filled"} (PrefixBlocks.stats) and prompt lookups
    # {"lookup_rows", "lookup_nodes"} where each is on
    # (worker_info.head_counters); None: neither
    head_prefix: dict | None
    num_generated_tokens: int = 0
    num_requests: int = 0  # finished


def read_repeat_state(llm, collectors: list | None, head_prefix: dict | None
                      ) -> RepeatState:
    """The counters now (`collectors`: as `read_engine_counts`);
    `head_prefix`: the worker's answer to `specplug_head_counters`."""
    metrics = read_engine_metrics(llm, collectors)  # the engine's collectors put back
    counts = read_spec_decode_counts(llm, metrics)
    totals = dict.fromkeys(COUNTERS, 0)
    for metric in metrics:
        if metric.name in totals:
            totals[metric.name] += int(getattr(metric, "value", 0))
    return RepeatState(counts, totals[PREFIX_QUERIES], totals[PREFIX_HITS], head_prefix,
                       totals[GENERATION_TOKENS], totals[REQUESTS_DONE])


def tokens_per_step(num_decoded: int, num_drafts: int, num_accepted: int) -> float | None:
    """Tokens a step over every decode step: `num_decoded` tokens after
    each request's first, `num_drafts` steps with a draft accepting
    `num_accepted` tokens past their first; each other step made one token
    (a step whose draft the grammar cut to nothing, or none was asked for).
    None without decoded tokens."""
    if num_decoded <= 0:
        return None
    undrafted = max(num_decoded - num_drafts - num_accepted, 0)
    return num_decoded / (num_drafts + undrafted)


def repeat_record(before: RepeatState, after: RepeatState,
                  decode_ms: float | None = None) -> dict:
    """What one repeat added (a row's `repeats` entry, JSON-ready);
    `decode_ms`: its waves' decode time, summed (bench/waves.py; None: the
    engine kept no per-request stats)."""
    counts = after.counts - before.counts
    queries = after.prefix_queries - before.prefix_queries
    head = (None if after.head_prefix is None or before.head_prefix is None
            else {k: after.head_prefix[k] - before.head_prefix[k] for k in after.head_prefix})
    return {"num_drafts": counts.num_drafts,
            "num_accepted_tokens": counts.num_accepted_tokens,
            "mean_acceptance_length": (None if counts.num_drafts == 0
                                       else counts.mean_acceptance_length),
            "per_position_acceptance": counts.per_position_acceptance,
            "prefix_queries": queries,
            "prefix_hits": after.prefix_hits - before.prefix_hits,
            "head_prefix": head,
            "tokens_per_step": tokens_per_step(
                (after.num_generated_tokens - before.num_generated_tokens)
                - (after.num_requests - before.num_requests),
                counts.num_drafts, counts.num_accepted_tokens),
            "decode_ms": decode_ms}


def repeat_fields(repeats: list[dict]) -> list[str]:
    """The "by repeat" table's fields for one row, each with its repeats'
    values one after another: τ, tokens a step, verify steps, decode ms, the
    prefix cache's hit rate, our head's prefix hits adopted/missed/filled
    and the requests and nodes its prompt lookups drafted."""
    def joined(values) -> str:
        return " ".join(values)

    return [joined("-" if r["mean_acceptance_length"] is None
                   else f"{r['mean_acceptance_length']:.3f}" for r in repeats),
            joined("-" if r.get("tokens_per_step") is None  # files of older runs
                   else f"{r['tokens_per_step']:.3f}" for r in repeats),
            joined(str(r["num_drafts"]) for r in repeats),
            joined("-" if r.get("decode_ms") is None  # files of older runs
                   else f"{r['decode_ms']:.0f}" for r in repeats),
            joined(f"{r['prefix_hits'] / r['prefix_queries']:.2f}" if r["prefix_queries"]
                   else "-" for r in repeats),
            joined(_cells(r["head_prefix"], HEAD_PREFIX_CELLS) for r in repeats),
            joined(_cells(r["head_prefix"], LOOKUP_CELLS) for r in repeats)]


def _cells(counters: dict | None, keys: tuple[str, ...]) -> str:
    """`keys`' values of a repeat's head counters joined by "/", "-" where
    it has none of them (that part is off)."""
    if not counters or keys[0] not in counters:
        return "-"
    return "/".join(str(counters[k]) for k in keys)


HEAD_PREFIX_CELLS = ("adopted", "missed", "filled")  # PrefixBlocks.stats
LOOKUP_CELLS = ("lookup_rows", "lookup_nodes")  # prompt lookups (proposers/lookup.py)
REPEAT_HEADS = ("accept len", "tokens a step", "verify steps", "decode ms", "prefix hits",
                "head hits adopted/missed/filled", "lookups rows/nodes")


def repeat_widths(rows_fields: list[list[str]]) -> list[int]:
    """Each field's width over every row: its widest value or heading, and
    two spaces (5 repeats of τ are 29 characters: fixed widths ran fields
    together in docs/results/batch_draft_length_cpu_run19)."""
    return [max([len(head)] + [len(fields[i]) for fields in rows_fields]) + 2
            for i, head in enumerate(REPEAT_HEADS)]


def repeat_line(fields, widths: list[int]) -> str:
    """Headings or one row's fields, each padded to its width."""
    return "  " + "".join(f"{field:<{width}}" for field, width in zip(fields, widths)).rstrip()
