"""Where a tree step's time goes, measured in the worker (opt-in: benchmarks
and the cost model of docs/tree-cuda.md).

Marks at the phase boundaries of one V1-runner step of `specplug_eagle3` /
`specplug_mtp`: inputs prepared (tree layout written), verification start
(the target forward, logits included, has run), verification end (tree
verification + KV compaction), drafting start and end. Each mark waits for
the device first, so a phase's time is its GPU work plus its host work. Off
by default: an enabled profiler costs one device sync per mark.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

PHASES = ("inputs_ready", "verify_start", "verify_end", "draft_start", "draft_end")


@dataclass
class StepRecord:
    num_reqs: int
    num_tokens: int  # scheduled tokens (tree nodes of every request)
    forward_s: float  # target forward over the nodes, logits included
    verify_s: float  # tree verification + KV compaction
    draft_s: float  # head ingest + tree drafting
    step_s: float | None  # since the previous step's inputs were ready (None: first)


class TreeProfiler:
    def __init__(self) -> None:
        self.enabled = False
        self.records: list[StepRecord] = []
        self._marks: dict[str, float] = {}
        self._last_ready: float | None = None
        self._shape: tuple[int, int] = (0, 0)

    def enable(self, on: bool) -> None:
        self.enabled = on
        self._marks.clear()
        self._last_ready = None

    def mark(self, phase: str, num_reqs: int = 0, num_tokens: int = 0) -> None:
        if not self.enabled:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if phase == "inputs_ready":
            self._marks = {}
            self._shape = (num_reqs, num_tokens)
        self._marks[phase] = now
        if phase == "draft_end" and len(self._marks) == len(PHASES):
            self._record(now)

    def _record(self, now: float) -> None:
        m = self._marks
        ready = m["inputs_ready"]
        self.records.append(StepRecord(
            *self._shape, m["verify_start"] - ready, m["verify_end"] - m["verify_start"],
            now - m["draft_start"],
            None if self._last_ready is None else ready - self._last_ready))
        self._last_ready = ready

    def take(self) -> list[dict]:
        """The records so far (as dicts), cleared."""
        taken = [asdict(r) for r in self.records]
        self.records.clear()
        return taken


PROFILER = TreeProfiler()
