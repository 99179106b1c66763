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
states there, the token after each, its position) into a per-slot store:
when every request decodes, the rows kernel and the hidden-state gather of
the fused step (`StepInputs`), then one graph replay captured at start-up
(few host launches: at batch 1, where the host's work shows in a step's
time, the same step with a dozen eager launches ran at 0.66x of no
speculation on SmolLM2: docs/results/batch_draft_length_h200_run15). The head takes them in one padded ingest (a graph replay,
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
KEEP_KIND = "keep"  # PassGraphs' kind of the keep pass


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
        self.graphs_stale = False  # the store was reallocated: keep passes run eagerly
        self.num_kept_steps = 0  # steps whose rows were kept (stats, tests)
        self.num_replayed = 0  # of those, kept by a graph replay
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

    def keep(self, rows: VerifiedRows, target: torch.Tensor, slots: np.ndarray,
             graphs=None, version: int = 0) -> None:
        """A step's verified rows of the B = len(slots) requests at `slots`
        after what those slots kept; no host sync. `rows` may be padded to P
        >= B requests (R rows each) by repeating the last one, `target` is
        [P * R, W]. With `graphs` (the head's `PassGraphs`) a graph captured
        at start-up for (P, R) replays the pass, reading `rows` and `target`
        in place; with none captured it runs eagerly (a capture runs its
        pass twice, and counting rows twice would break the store)."""
        if self._allocate(target.shape[1], target.dtype):
            self.graphs_stale = True  # those captured wrote to the store just replaced
        inputs = [rows.slots, rows.positions, rows.next_ids, rows.cuts, rows.root_positions,
                  target]
        key = keep_key(rows.slots.shape[0], rows.positions.shape[1], target)
        if graphs is not None and not self.graphs_stale and graphs.holds(version, key) \
                and graphs.run(version, key, self._keep_pass, inputs, own_inputs=True)[0]:
            self.num_replayed += 1
        else:
            self._keep_pass(*inputs)
        self.bound[slots] += rows.positions.shape[1]
        self.num_kept_steps += 1

    def _keep_pass(self, slot_ids: torch.Tensor, positions: torch.Tensor,
                   next_ids: torch.Tensor, cuts: torch.Tensor, root_positions: torch.Tensor,
                   target: torch.Tensor) -> None:
        """`keep` on device tensors (shapes fixed by positions [P, R]: a graph
        can capture it). A slot listed twice (padding) writes the same rows
        and count twice."""
        num_rows = positions.shape[1]
        num_verified = root_positions - cuts  # [P]
        columns = self.columns[:num_rows]
        count = self.count[slot_ids]  # [P], before this step
        dest = torch.where(columns < num_verified[:, None], count[:, None] + columns,
                           self.max_rows)  # [P, R]; unverified rows: the spare column
        index = (slot_ids[:, None].expand(-1, num_rows), dest)
        self.positions.index_put_(index, positions)
        self.next_ids.index_put_(index, next_ids.view(-1, num_rows))
        self.hidden.index_put_(index, target.view(-1, num_rows, target.shape[-1]))
        self.count.index_put_((slot_ids,), count + num_verified)

    def _allocate(self, width: int, dtype: torch.dtype) -> bool:
        """The store of the target's rows at this layout; True when one of
        another layout was replaced (the layout start-up assumed was wrong)."""
        if self.hidden is not None and self.hidden.shape[2] == width \
                and self.hidden.dtype == dtype:
            return False
        replaced = self.hidden is not None
        self.hidden = torch.zeros(self.positions.shape[0], self.max_rows + 1, width,
                                  dtype=dtype, device=self.device)
        return replaced

    def flush(self, runtime, slots: np.ndarray, max_position: int) -> None:
        """Ingest what `slots` kept, in one padded pass of MAX_KEPT_ROWS rows
        a request (the last kept row repeated: `_ingest_pass`'s layout), and
        forget it. `max_position` bounds every kept position from above."""
        slots = slots[self.bound[slots] > 0]
        if not len(slots):
            return
        slot_ids = to_device(slots, self.device)
        self._ingest(runtime, slot_ids, max_position)
        self.bound[slots] = 0
        self.count.index_fill_(0, slot_ids, 0)
        self.num_flushes += 1

    def _ingest(self, runtime, slot_ids: torch.Tensor, max_position: int) -> None:
        last = (self.count[slot_ids] - 1).clamp_(min=0)  # [P]
        take = torch.minimum(self.columns[None, :], last[:, None])  # [P, M]
        index = (slot_ids[:, None].expand_as(take), take)
        runtime.ingest_padded(slot_ids, self.hidden[index].flatten(0, 1),
                              self.next_ids[index].flatten(), self.positions[index],
                              self.positions[slot_ids, 0], max_position)

    def warm_up(self, runtime, step_rows, sizes: list[int], row_counts: list[int],
                width: int, dtype: torch.dtype) -> int:
        """Capture, at each padded batch size of `sizes`, the flush's graph
        and the keep pass's at each of `row_counts` rows per request, on
        placeholder rows (`step_rows(size, R)` -> the persistent (rows,
        target) service keeps from: the addresses its graphs read); then
        forget what they wrote. The caller clears the head's cache after
        (`step_warmup._forget_placeholders`). Returns the graphs captured."""
        self._allocate(width, dtype)
        graphs, count = runtime.graphs, 0
        num_slots = self.positions.shape[0]
        for size in sizes:
            self._ingest(runtime, torch.arange(size, device=self.device) % num_slots,
                         self.max_rows)
            count += 1
            for num_rows in row_counts:
                rows, target = step_rows(size, num_rows)
                rows.slots.copy_(torch.arange(size, device=self.device) % num_slots)
                rows.positions.copy_(torch.arange(num_rows, device=self.device).expand(
                    size, num_rows))
                rows.cuts.zero_()
                rows.next_ids.zero_()  # the flushes after read them as token ids
                rows.root_positions.fill_(1)  # one verified row: no write past the store
                target.zero_()
                inputs = [rows.slots, rows.positions, rows.next_ids, rows.cuts,
                          rows.root_positions, target]
                if graphs is None or not graphs.run(runtime.pool.version,
                                                    keep_key(size, num_rows, target),
                                                    self._keep_pass, inputs, own_inputs=True)[0]:
                    self._keep_pass(*inputs)  # eager (CPU): it only runs
                self.count.zero_()
                count += 1
        self.count.zero_()
        return count


def keep_key(num_padded: int, num_rows: int, target: torch.Tensor) -> tuple:
    """The PassGraphs key of a keep pass: padded batch, rows a request, and
    the target's layout (width, dtype)."""
    return (KEEP_KIND, num_padded, num_rows, target.shape[-1], target.dtype)
