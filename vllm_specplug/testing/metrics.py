"""Speculative-decoding counters read from vLLM's own metrics.

vLLM exports `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos` (see
`vllm/v1/spec_decode/metrics.py`). Counters are cumulative per process, so
callers take a snapshot before and after the work they measure and subtract.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest

_PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class SpecDecodeCounts:
    num_drafts: int = 0  # verify steps that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = field(default_factory=tuple)

    def __sub__(self, other: "SpecDecodeCounts") -> "SpecDecodeCounts":
        return SpecDecodeCounts(
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted_tokens - other.num_accepted_tokens,
            tuple(a - b for a, b in zip_longest(self.accepted_per_pos,
                                                other.accepted_per_pos, fillvalue=0)))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 (bonus) + accepted per draft."""
        if self.num_drafts == 0:
            return float("nan")
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts whose token at position i was accepted."""
        if self.num_drafts == 0:
            return []
        return [n / self.num_drafts for n in self.accepted_per_pos]


def read_spec_decode_counts(llm) -> SpecDecodeCounts:
    """Current cumulative counters of `llm`, summed over engines and labels."""
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        if not metric.name.startswith(_PREFIX):
            continue
        key = metric.name[len(_PREFIX):]
        if key == "num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip_longest(per_pos, metric.values, fillvalue=0)]
        elif key in totals:
            totals[key] += int(metric.value)
    return SpecDecodeCounts(accepted_per_pos=tuple(per_pos), **totals)
