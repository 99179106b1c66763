"""The accepted paths' node ranks of each step, for the batch policy on the
host (integration/batch_schedule.py), one step late and without a host sync.

A tree's node ranks by path score say which nodes a smaller tree drafted
from the same pool would have kept (`score_ranks`: the tree of k + 1 nodes
keeps the nodes of rank < k, and ranks rise along a path). So the accepted
path of a 16-node tree also tells how many drafts each smaller tree would
have had accepted, for the same requests on the same step, where the policy
otherwise learnt a size only on the rare steps it tried it, on other
requests (docs/results/batch_draft_length_h200_run7).

Model Runner V2 runs the step after this one before the host needs these,
so each step's ranks are copied into pinned memory behind its own work and
read one step later, when that copy has long finished: two buffers, each
with its event.
"""
from __future__ import annotations

import numpy as np
import torch


class PathRanks:
    def __init__(self, max_num_reqs: int, num_nodes: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.buffers = [torch.empty(max_num_reqs, num_nodes - 1, dtype=torch.int32,
                                    pin_memory=pinned) for _ in range(2)]  # [S, N - 1]
        self.events = [torch.cuda.Event() if pinned else None for _ in range(2)]
        # what each buffer holds, if anything: (drafts verified per request,
        # the rows that verified that many)
        self.held: list[tuple[int, np.ndarray] | None] = [None, None]
        self.turn = 0  # the buffer the next `record` writes

    def record_step(self, input_batch, tree_slots) -> None:
        """The paths the tree sampler just accepted (`TreeSlots.path_ranks`),
        for the rows that verified the step's draft count (not prefill rows,
        nor rows scheduled fewer drafts)."""
        num_reqs = input_batch.num_reqs
        scheduled = input_batch.num_scheduled_tokens[:num_reqs]
        decoding = ~input_batch.is_prefilling_np[:num_reqs]
        if not decoding.any():
            return
        num_drafts = int(scheduled[decoding].max()) - 1
        rows = np.flatnonzero((scheduled == num_drafts + 1) & decoding)
        if num_drafts > 0:
            self.record(tree_slots.path_ranks(input_batch.idx_mapping, num_reqs), num_drafts,
                        rows)

    def record(self, ranks: torch.Tensor, num_drafts: int, rows: np.ndarray) -> None:
        """This step's [B, N - 1] path ranks (`TreeSlots.path_ranks`), copied
        to the host behind the step's work; the rows `rows` verified
        `num_drafts` drafts each (the others: prefill, or fewer)."""
        i = self.turn
        self.buffers[i][:ranks.shape[0]].copy_(ranks.to(torch.int32),
                                               non_blocking=self.events[i] is not None)
        if self.events[i] is not None:
            self.events[i].record()
        self.held[i], self.turn = (num_drafts, rows), 1 - i

    def take(self) -> tuple[int, np.ndarray] | None:
        """(drafts verified per request, [n, N - 1] the ranks of those rows,
        `num_nodes` past each path) as recorded the step before the last
        `record`, or None; each is taken once."""
        i = self.turn  # the older of the two
        if self.held[i] is None:
            return None
        num_drafts, rows = self.held[i]
        if self.events[i] is not None:
            self.events[i].synchronize()  # done a step ago: does not wait
        self.held[i] = None
        return num_drafts, self.buffers[i].numpy()[rows]
