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
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.req_ids: list[str] = []
        self.parents_host: torch.Tensor | None = None  # [B, N] int64, once the event passed
        self.copy_event = None  # the copy's CUDA event (None: copied already)

    def record(self, req_ids: list[str], parents: torch.Tensor) -> None:
        """`parents` [B, N] int64 (root included, -1 at the root): the trees
        just drafted for `req_ids`, a tensor of the current stream."""
        self.req_ids = list(req_ids)
        self.parents_host, self.copy_event = to_host_async(self.copy_stream, parents)

    def clear(self) -> None:
        self.req_ids, self.parents_host, self.copy_event = [], None, None

    def take(self) -> dict[str, list[int]]:
        """{req_id: parents} of the last recorded step (once: then cleared)."""
        if self.parents_host is None:
            return {}
        if self.copy_event is not None:
            self.copy_event.synchronize()
        taken = {req_id: row.tolist()
                 for req_id, row in zip(self.req_ids, self.parents_host.numpy())}
        self.clear()
        return taken


def to_host_async(stream, *tensors: torch.Tensor) -> tuple:
    """(host copies..., event): on CUDA copied on the side `stream` into
    pinned memory (as vLLM's async_copy_to_np) and not waited for (the
    event says when); elsewhere copied now (event None)."""
    if not tensors[0].is_cuda:
        return (*(tensor.clone() for tensor in tensors), None)
    stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
    with torch.cuda.stream(stream):
        copies = tuple(tensor.to("cpu", non_blocking=True) for tensor in tensors)
        for tensor in tensors:  # made on the step's stream, read on this one: keep the
            tensor.record_stream(stream)  # allocator from reusing it before the copy
        event = torch.cuda.Event(blocking=True)  # sleeps, not spins, when waited on
        event.record()
    return (*copies, event)
