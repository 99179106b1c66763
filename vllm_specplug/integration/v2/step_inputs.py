"""What a fused decode step of the head reads (head_speculator.py): the
tree shape of the step's drafts, and the persistent buffers its graph reads
in place."""
from __future__ import annotations

import torch

from vllm_specplug.verification.tree_rows import VerifiedRows


def step_tree_shape(shape: tuple[int, int, int],
                    num_drafts: int | None) -> tuple[int, int, int]:
    """(topk, num_steps, num_draft_tokens) of this step's trees, from the
    method's `shape`: vLLM's dynamic speculative decoding
    (`num_speculative_tokens_per_batch_size`) asks for `num_drafts` per
    request at this batch size, so the tree has that many nodes past the root
    (at least one; at 0 the head drafts nothing and keeps the step's rows,
    `deferred_rows.py`), and no more drafting steps than it can be deep, nor
    wider than it can keep. When the batch then shrinks, vLLM schedules more
    drafts than the tree has; tree verification stops at each slot's drafted nodes
    (`TreeSlots.num_drafted`), vLLM's own sampler rejects a chain's missing
    drafts."""
    topk, num_steps, num_nodes = shape
    if num_drafts is not None:
        num_nodes = max(2, min(num_nodes, num_drafts + 1))
    # EAGLE-2 keeps the best num_nodes - 1 nodes by path score, and a path's
    # score never rises: a kept node's parent is kept, and at most
    # num_nodes - 1 nodes outrank it at its depth or among its siblings. So
    # a beam and a top-k of num_nodes - 1 draft the same tree as wider ones
    # (ties aside), with fewer rows: a 3-node tree expands 2 x 2, not 4 x 4.
    return min(topk, num_nodes - 1), min(num_steps, num_nodes - 1), num_nodes


class StepInputs:
    """Persistent buffers a fused decode step's graph reads in place: views
    of them taken the same way for a given (padded batch, rows) always start
    at the same address."""

    def __init__(self, max_padded: int, max_rows: int, device: torch.device) -> None:
        self.max_padded, self.max_rows, self.device = max_padded, max_rows, device
        self.buffers = VerifiedRows.empty(max_padded, max_rows, device)
        self.batch_rows = torch.arange(max_padded, dtype=torch.int64, device=device)  # [Bp]
        self.target: torch.Tensor | None = None  # [Bp * R, *] the target's hidden states
        # [1] int64: the step's requests; the rows past them pad to a capture size
        self.num_requests = torch.zeros(1, dtype=torch.int64, device=device)

    def stored_slots(self, slots: torch.Tensor, spare: int) -> torch.Tensor:
        """slots [P] of a padded pass -> the same with the padding's rows
        sent to slot `spare`, where nothing reads (graph-safe: `num_requests`
        is read in place). Padding repeats the last request, slot included:
        its rows draft that request's tree again only if every op computes
        them bit for bit as the real row (a GEMM that tiles the padded rows
        apart need not), and a repeated index keeps an undefined one of the
        writes, each tree field apart (docs/results/smollm2_schema_t1_h100_s68)."""
        rows = self.batch_rows[:slots.shape[0]]
        return torch.where(rows < self.num_requests, slots, torch.full_like(slots, spare))

    def rows(self, size: int, num_rows: int) -> VerifiedRows:
        b, n = self.buffers, size * num_rows
        return VerifiedRows(b.token_rows[:n], b.positions.view(-1)[:n].view(size, num_rows),
                            b.next_ids[:n], b.slots[:size], b.cuts[:size], b.root_ids[:size],
                            b.root_positions[:size])

    def hidden(self, num: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        if self.target is None or self.target.shape[1] != width or self.target.dtype != dtype:
            self.target = torch.empty(self.max_padded * self.max_rows, width, dtype=dtype,
                                      device=self.device)
        return self.target[:num]
