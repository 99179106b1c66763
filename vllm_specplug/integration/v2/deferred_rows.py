"""Verified rows the head has not ingested yet, kept on the device while the
batch drafts nothing (issue 27; Model Runner V2).

Under a batch policy (`"adaptive": true`) or a `num_speculative_tokens_per_batch_size`
table, a step may ask for 0 drafts. The head still had to take in the step's
verified positions, to stay in sync with the request (TensorRT-LLM #16888),
and until now it did so by running its whole pass: ingest, then a one-node
draft nobody verifies. On the H200 that kept a step at length 0 28-41% above
no speculation's on SmolLM2 (2.63 vs 2.05 ms at batch 1, 4.15 vs 2.94 at 16;
docs/results/batch_draft_length_h200_run14): the policy's floor was above
turning speculation off, so it could never reach the goal.

Here a step at 0 drafts only copies its verified rows (the target's hidden
states there, the token after each, its position) into a per-slot store, a
few small kernels; the head takes them in one padded ingest (a graph replay,
`HeadRuntime.ingest_padded`) before its next draft, or when a slot's store
is full. The V1 runner does the same on the host (`v1/deferred_ingest.py`).

Ingesting positions p..q in one pass gives the head the keys and values of
ingesting them step by step: each row attends causally to the rows before it
either way, and what a row reads (the target's hidden states at p, the
token at p + 1) is fixed once p is verified. The last row's output and
logits (`HeadCachePool.set_last`) are the same too. Drafts only: output is
verification's.

With async scheduling the host does not know how many rows a step verified
(acceptance is on the device), so it keeps an upper bound per slot (the
step's padded row count) and the device keeps the count.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.verification.backend import to_device
from vllm_specplug.verification.tree_rows import VerifiedRows

# rows a slot may keep: a flush ingests exactly this many per request (the
# last repeated), so it replays one graph per padded batch size, captured at
# start-up (`warm_up`). A step at 0 drafts keeps 1 row a request, or up to
# num_steps + 1 right after a step that verified drafts.
MAX_KEPT_ROWS = 16


class DeferredRows:
    """Per state slot: up to MAX_KEPT_ROWS verified rows, oldest first."""

    def __init__(self, max_num_reqs: int, device: torch.device,
                 max_rows: int = MAX_KEPT_ROWS) -> None:
        self.max_rows, self.device = max_rows, device
        # column max_rows takes the writes of rows a step did not verify
        self.positions = torch.zeros(max_num_reqs, max_rows + 1, dtype=torch.int64,
                                     device=device)  # [S, M + 1]
        self.next_ids = torch.zeros_like(self.positions)  # [S, M + 1] int64
        self.hidden: torch.Tensor | None = None  # [S, M + 1, W] the target's dtype
        self.count = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)  # [S]
        self.bound = np.zeros(max_num_reqs, dtype=np.int64)  # [S] host: >= count
        self.columns = torch.arange(max_rows, device=device)  # [M]
        self.num_kept_steps = 0  # steps whose rows were kept (stats, tests)
        self.num_flushes = 0  # ingests of kept rows

    def drop(self, slots: np.ndarray) -> None:
        """Forget what `slots` kept (a new request there, or a prefill that
        ingests its positions itself)."""
        slots = slots[self.bound[slots] > 0]
        if len(slots):
            self.bound[slots] = 0
            self.count.index_fill_(0, to_device(slots, self.device), 0)

    def has_room(self, slots: np.ndarray, num_rows: int) -> bool:
        return bool((self.bound[slots] + num_rows <= self.max_rows).all())

    def keep(self, rows: VerifiedRows, target: torch.Tensor, slots: np.ndarray) -> None:
        """A step's verified rows of its B = len(slots) requests (`rows`
        padded to P >= B requests of R rows, `target` [P * R, W]) after what
        their slots kept; no host sync."""
        num_reqs, num_rows = len(slots), rows.positions.shape[1]
        if self.hidden is None or self.hidden.shape[2:] != target.shape[1:] \
                or self.hidden.dtype != target.dtype:
            self.hidden = target.new_zeros(self.positions.shape[0], self.max_rows + 1,
                                           *target.shape[1:])
        slot_ids = rows.slots[:num_reqs]
        num_verified = (rows.root_positions - rows.cuts)[:num_reqs]  # [B]
        columns = self.columns[:num_rows]
        dest = torch.where(columns < num_verified[:, None], self.count[slot_ids, None] + columns,
                           self.max_rows)  # [B, R]
        index = (slot_ids[:, None].expand(-1, num_rows), dest)
        self.positions.index_put_(index, rows.positions[:num_reqs])
        self.next_ids.index_put_(index, rows.next_ids.view(-1, num_rows)[:num_reqs])
        self.hidden.index_put_(index, target.view(-1, num_rows, *target.shape[1:])[:num_reqs])
        self.count.index_add_(0, slot_ids, num_verified)
        self.bound[slots] += num_rows
        self.num_kept_steps += 1

    def flush(self, runtime, slots: np.ndarray, max_position: int) -> None:
        """Ingest what `slots` kept, in one padded pass of MAX_KEPT_ROWS rows
        a request (the last kept row repeated: `_ingest_pass`'s layout), and
        forget it. `max_position` bounds every kept position from above."""
        slots = slots[self.bound[slots] > 0]
        if not len(slots):
            return
        self._ingest(runtime, to_device(slots, self.device), max_position)
        self.bound[slots] = 0
        self.count.index_fill_(0, to_device(slots, self.device), 0)
        self.num_flushes += 1

    def _ingest(self, runtime, slot_ids: torch.Tensor, max_position: int) -> None:
        last = (self.count[slot_ids] - 1).clamp_(min=0)  # [P]
        take = torch.minimum(self.columns[None, :], last[:, None])  # [P, M]
        index = (slot_ids[:, None].expand_as(take), take)
        runtime.ingest_padded(slot_ids, self.hidden[index].flatten(0, 1),
                              self.next_ids[index].flatten(), self.positions[index],
                              self.positions[slot_ids, 0], max_position)

    def warm_up(self, runtime, sizes: list[int], width: int, dtype: torch.dtype) -> None:
        """Capture the flush's graph at each padded batch size of `sizes`, on
        placeholder rows (positions 0.., zero hidden states); the caller
        clears the head's cache after (`step_warmup._forget_placeholders`)."""
        if self.hidden is None:
            self.hidden = torch.zeros(self.positions.shape[0], self.max_rows + 1, width,
                                      dtype=dtype, device=self.device)
        num_slots = self.positions.shape[0]
        for size in sizes:
            self._ingest(runtime, torch.arange(size, device=self.device) % num_slots,
                         self.max_rows)
