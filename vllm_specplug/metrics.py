"""Speculative-decoding counters read from vLLM's own metrics.

vLLM exports `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos` (see
`vllm/v1/spec_decode/metrics.py`), offline through `LLM.get_metrics()` and
online as Prometheus text on a server's `/metrics`. Counters are cumulative
per process, so callers take a snapshot before and after the work they measure
and subtract. Several engines in one process: each new engine's stat logger
takes vLLM's Prometheus registry over (it unregisters the collectors before
it), so an older engine is read with `read_engine_counts` and the collectors
it had (`vllm_collectors`, taken right after it was made).
"""
from __future__ import annotations

import re
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import zip_longest

_PREFIX = "vllm:spec_decode_"
_PER_POS = "num_accepted_tokens_per_pos"
_TOTALS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
# One Prometheus sample line: name{labels} value
_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass(frozen=True)
class SpecDecodeCounts:
    num_drafts: int = 0  # verify steps that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = field(default_factory=tuple)

    def _combine(self, other: "SpecDecodeCounts", sign: int) -> "SpecDecodeCounts":
        return SpecDecodeCounts(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            tuple(a + sign * b for a, b in zip_longest(
                self.accepted_per_pos, other.accepted_per_pos, fillvalue=0)))

    def __sub__(self, other: "SpecDecodeCounts") -> "SpecDecodeCounts":
        return self._combine(other, -1)

    def __add__(self, other: "SpecDecodeCounts") -> "SpecDecodeCounts":
        return self._combine(other, 1)

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

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "mean_acceptance_length": (None if self.num_drafts == 0
                                           else self.mean_acceptance_length),
                "per_position_acceptance": self.per_position_acceptance}


def read_spec_decode_counts(llm, metrics: list | None = None) -> SpecDecodeCounts:
    """Current cumulative counters of `llm`, summed over engines and labels
    (`metrics`: `llm.get_metrics()` already read)."""
    totals = dict.fromkeys(_TOTALS, 0)
    per_pos: list[int] = []
    for metric in llm.get_metrics() if metrics is None else metrics:
        if not metric.name.startswith(_PREFIX):
            continue
        key = metric.name[len(_PREFIX):]
        if key == _PER_POS:
            per_pos = [a + b for a, b in zip_longest(per_pos, metric.values, fillvalue=0)]
        elif key in totals:
            totals[key] += int(metric.value)
    return SpecDecodeCounts(accepted_per_pos=tuple(per_pos), **totals)


def vllm_collectors() -> list:
    """vLLM's Prometheus collectors registered now: right after an `LLM` is
    made, that engine's own (it unregistered the ones before it)."""
    from prometheus_client import REGISTRY

    return [collector for collector in list(REGISTRY._collector_to_names)
            if getattr(collector, "_name", "").startswith("vllm:")]


class ThreadCollectors:
    """vLLM's collectors that each thread registered (`collectors_by_thread`)."""

    def __init__(self) -> None:
        self.by_thread: dict[int, list] = defaultdict(list)

    def collectors(self) -> list:
        """The calling thread's, in the order it registered them."""
        return list(self.by_thread.get(threading.get_ident(), ()))


@contextmanager
def collectors_by_thread():
    """While engines are made in several threads at once (bench/starts.py):
    vLLM's collectors kept per registering thread, the latest registration
    of a name winning over an earlier one, and the unregistration of one
    already gone ignored. vLLM's stat loggers, made at once, would otherwise
    unregister each other's collectors halfway (`unregister_vllm_metrics`)
    and register duplicates (prometheus_client's ValueError). Each logger is
    made in the thread that makes its engine. The registry's own methods
    are back on exit."""
    from prometheus_client import REGISTRY

    lock, found = threading.RLock(), ThreadCollectors()
    register, unregister = REGISTRY.register, REGISTRY.unregister

    def register_latest(collector) -> None:
        with lock:
            name = getattr(collector, "_name", "")
            if name.startswith("vllm:"):
                found.by_thread[threading.get_ident()].append(collector)
                for other in [c for c in REGISTRY._collector_to_names
                              if getattr(c, "_name", None) == name]:
                    unregister(other)
            register(collector)

    def unregister_present(collector) -> None:
        with lock:
            if collector in REGISTRY._collector_to_names:
                unregister(collector)

    REGISTRY.register, REGISTRY.unregister = register_latest, unregister_present
    try:
        yield found
    finally:
        del REGISTRY.register, REGISTRY.unregister


def read_engine_counts(llm, collectors: list | None) -> SpecDecodeCounts:
    """`read_spec_decode_counts` of the engine whose collectors these are,
    put back into the registry first (None: the registry as it is)."""
    return read_spec_decode_counts(llm, read_engine_metrics(llm, collectors))


def read_engine_metrics(llm, collectors: list | None) -> list:
    """`llm.get_metrics()` of the engine whose collectors these are, put
    back into the registry first (None: the registry as it is)."""
    if collectors is not None:
        from prometheus_client import REGISTRY

        for collector in vllm_collectors():  # as vLLM's `unregister_vllm_metrics`
            REGISTRY.unregister(collector)
        for collector in collectors:
            REGISTRY.register(collector)
    return llm.get_metrics()


def parse_prometheus_counts(text: str) -> SpecDecodeCounts:
    """The same counters from a server's `/metrics` page (Prometheus text),
    summed over engines and models. A server without speculation reads zero."""
    totals = dict.fromkeys(_TOTALS, 0)
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or not match["name"].startswith(_PREFIX):
            continue
        key = match["name"][len(_PREFIX):].removesuffix("_total")
        value = int(float(match["value"]))
        if key == _PER_POS:
            position = _POSITION.search(match["labels"] or "")
            if position:
                index = int(position.group(1))
                per_pos[index] = per_pos.get(index, 0) + value
        elif key in totals:
            totals[key] += value
    ordered = tuple(per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1))
    return SpecDecodeCounts(accepted_per_pos=ordered, **totals)
