"""Verified positions a head has not ingested yet, per request (issue 27).

A head drafter keeps its own KV current by ingesting every verified position
with the target's hidden states there (`TreeEagleDrafter._ingest`). Under a
tree budget that skips a request's drafting pass, that ingest is part of
what a skipped step still costs (on CPU the tiny model at batch 16 ran its
steps without drafts at about 30 ms against no speculation's 22 ms;
docs/results/tree_budget_cpu). So a request that does not draft this step
keeps its verified rows here instead (the target's hidden states are gone
after the step, so they are copied), and the head takes them in one pass,
before its own rows, the next time the request drafts. A request that
finishes first never pays for them.

Ingesting positions p..q in one pass gives the head the same keys and values
as ingesting them step by step: each row attends causally to the rows before
it either way (EAGLE-3's head reads embed(token p + 1) and the target's
hidden states at p, both fixed once p is verified).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class PendingRows:
    """One request's verified rows not yet ingested, oldest first."""
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n_i, *] target dtype
    next_ids: list[np.ndarray] = field(default_factory=list)  # [n_i] int64
    positions: list[np.ndarray] = field(default_factory=list)  # [n_i] int64

    @property
    def num_rows(self) -> int:
        return sum(len(p) for p in self.positions)


# rows a request may keep back: past this its rows are ingested whether it
# drafts or not (memory: the target's hidden states per row, 3 x hidden for
# an EAGLE-3 head)
MAX_DEFERRED_ROWS = 1024


class DeferredIngest:
    """{req_id: PendingRows}: rows kept back while a request does not draft."""

    def __init__(self) -> None:
        self.pending: dict[str, PendingRows] = {}
        self.num_deferred = 0  # rows kept back, over the engine's life (stats)
        self.num_dropped = 0  # of those, rows never ingested (the request ended first)

    def has_room(self, req_id: str, num_rows: int) -> bool:
        rows = self.pending.get(req_id)
        return (0 if rows is None else rows.num_rows) + num_rows <= MAX_DEFERRED_ROWS

    def defer(self, req_id: str, hidden: torch.Tensor, next_ids: np.ndarray,
              positions: np.ndarray) -> None:
        """Keep `hidden` ([n, *], copied: the step's buffer is reused),
        `next_ids` and `positions` ([n]) for `req_id`."""
        rows = self.pending.setdefault(req_id, PendingRows())
        rows.hidden.append(hidden.clone())
        rows.next_ids.append(next_ids)
        rows.positions.append(positions)
        self.num_deferred += len(positions)

    def with_pending(self, req_id: str, hidden: torch.Tensor, next_ids: np.ndarray,
                     positions: np.ndarray) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """This step's rows of `req_id` with its kept rows before them (all of
        them leave the store)."""
        rows = self.pending.pop(req_id, None)
        if rows is None:
            return hidden, next_ids, positions
        return (torch.cat(rows.hidden + [hidden]), np.concatenate(rows.next_ids + [next_ids]),
                np.concatenate(rows.positions + [positions]))

    def forget(self, req_id: str) -> None:
        rows = self.pending.pop(req_id, None)
        if rows is not None:
            self.num_dropped += rows.num_rows
