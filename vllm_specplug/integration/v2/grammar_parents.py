"""Each drafted tree's parents, for the scheduler's grammar check (issue 30).

Under async scheduling a step with structured output has its bitmask built
after its drafts reach the scheduler: the engine core takes them from the
worker (`take_draft_token_ids`; vLLM's `DraftTokensHandler` copies them to
the host on a side stream). For trees the scheduler also needs each node's
parent, to check every node in the grammar state of its own path and mask
its row there (`SpecplugTreeAsyncScheduler`, integration/grammar_trees.py).
The parents of the batch's trees go to the host the same way, beside the
drafts: queued on a side stream after the drafting pass, so the step keeps
no host synchronisation; the host waits only when the scheduler asks.
"""
from __future__ import annotations

import torch


class GrammarParents:
    def __init__(self, device: torch.device) -> None:
        self.copy_stream = torch.cuda.Stream(device)
        self.copy_event = torch.cuda.Event(blocking=True)
        self.req_ids: list[str] = []
        self.parents_np = None  # [B, N] int64 on the host, once the event passed

    def record(self, req_ids: list[str], parents: torch.Tensor) -> None:
        """`parents` [B, N] int64 (root included, -1 at the root): the trees
        just drafted for `req_ids`, a tensor of the current stream."""
        self.req_ids = list(req_ids)
        self.copy_stream.wait_stream(torch.cuda.current_stream(parents.device))
        with torch.cuda.stream(self.copy_stream):
            # a non-blocking copy to the host lands in pinned memory (as vLLM's
            # async_copy_to_np): complete once the event has passed
            self.parents_np = parents.to("cpu", non_blocking=True, copy=True).numpy()
            # read here on the side stream: keep the allocator from reusing it
            parents.record_stream(self.copy_stream)
            self.copy_event.record()

    def clear(self) -> None:
        self.req_ids, self.parents_np = [], None

    def take(self) -> dict[str, list[int]]:
        """{req_id: parents} of the last recorded step (once: then cleared)."""
        if self.parents_np is None:
            return {}
        self.copy_event.synchronize()
        taken = {req_id: row.tolist() for req_id, row in zip(self.req_ids, self.parents_np)}
        self.clear()
        return taken
