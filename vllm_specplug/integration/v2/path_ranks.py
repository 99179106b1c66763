"""The accepted paths' node ranks of each step, for the batch policy on the
host (integration/batch_schedule.py), one step late and without a host sync.

A tree's node ranks by path score say which nodes a smaller tree drafted
from the same pool would have kept (`score_ranks`: the tree of k + 1 nodes
keeps the nodes of rank < k, and ranks rise along a path). So the accepted
path of a 16-node tree also tells how many drafts each smaller tree would
have had accepted, for the same requests on the same step, where the policy
otherwise learnt a size only on the rare steps it tried it, on other
requests (docs/results/batch_draft_length_h200_run7).

Each step's ranks are copied into pinned memory behind its own work and
read at a later step, once that copy has finished, never waiting for it: a
ring of `NUM_BUFFERS`, each with its event. (Read one step later with a
wait on its event, as this did first, the host waited for the GPU once a
step: under async scheduling it launches a step while the GPU still runs
the one before. On the H200, batch 1 to 64, the adaptive tree ran its 15
nodes on 97-100% of its steps at 0.65-0.88x of the static tree's tokens/s,
where one without the paths had run even with it;
docs/results/batch_draft_length_h200_run9.)
"""
from __future__ import annotations

import numpy as np
import torch


# steps whose ranks may wait to be read: the host runs at most a step or two
# ahead of the GPU; past that, the oldest are dropped (the policy learns from
# the steps it reads)
NUM_BUFFERS = 4
# one tree step in this many records its paths: a record costs the step about
# eight launches and its host work, where the policy needs a sample of the
# paths only (each step's holds every request's). On the H200 (tiny model,
# batch 16) the adaptive tree pinned at 15 nodes, recording every step, ran
# 6.3k tok/s where vLLM's table at 15 drafts ran 9.0k: 60 launches a step
# against 52, 0.55 ms more host time a step
# (docs/results/batch_draft_length_h200_run10)
RECORD_EVERY = 4


class PathRanks:
    def __init__(self, max_num_reqs: int, num_nodes: int, device: torch.device,
                 record_every: int = RECORD_EVERY) -> None:
        pinned = device.type == "cuda"
        self.buffers = [torch.empty(max_num_reqs, num_nodes - 1, dtype=torch.int32,
                                    pin_memory=pinned)
                        for _ in range(NUM_BUFFERS)]  # [S, N - 1]
        self.events = [torch.cuda.Event() if pinned else None for _ in range(NUM_BUFFERS)]
        # what each buffer holds, if anything: (record number, drafts verified
        # per request, the rows that verified that many)
        self.held: list[tuple[int, int, np.ndarray] | None] = [None] * NUM_BUFFERS
        self.num_recorded = 0  # the next record's number; it writes buffer % NUM_BUFFERS
        self.num_dropped = 0  # records overwritten before they were read
        self.record_every, self.num_tree_steps = record_every, 0

    def due(self, sample_every: int = 1) -> bool:
        """Counts a tree step: whether it is one in `record_every` times the
        batch policy's `sample_every` (settled, it reads its steps that much
        rarer), to `record_step` (asked first: a step that records nothing
        costs no call)."""
        self.num_tree_steps += 1
        return (self.num_tree_steps - 1) % (self.record_every * sample_every) == 0

    def record_step(self, input_batch, tree_slots) -> None:
        """The paths the tree sampler just accepted (`TreeSlots.path_ranks`),
        for the rows that verified the step's draft count (not prefill rows,
        nor rows scheduled fewer drafts), on a step that was `due`."""
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
        i = self.num_recorded % NUM_BUFFERS
        self.num_dropped += self.held[i] is not None
        self.buffers[i][:ranks.shape[0]].copy_(ranks.to(torch.int32),
                                               non_blocking=self.events[i] is not None)
        if self.events[i] is not None:
            self.events[i].record()
        self.held[i] = (self.num_recorded, num_drafts, rows)
        self.num_recorded += 1

    def take(self) -> tuple[int, np.ndarray] | None:
        """(drafts verified per request, [n, N - 1] the ranks of those rows,
        `num_nodes` past each path) of the oldest record not yet read, if
        it is older than the last one and its copy has finished (else None:
        read at a later call); each is taken once."""
        held = [h for h in self.held if h is not None and h[0] < self.num_recorded - 1]
        if not held:
            return None
        number, num_drafts, rows = min(held, key=lambda h: h[0])
        i = number % NUM_BUFFERS
        if self.events[i] is not None and not self.events[i].query():
            return None  # the GPU is still behind it: never wait here
        self.held[i] = None
        return num_drafts, self.buffers[i].numpy()[rows]
