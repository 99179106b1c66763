"""Drafting passes as captured CUDA graphs.

A drafting pass (`HeadRuntime._draft_pass`: num_steps expansions of the
drafter, top-k, pooling, the tree build kernel) launches a few hundred small
kernels; eager, their launch cost is most of a step at small batches. Its
shapes are fixed by (batch, keys read, tree shape) and it never syncs with
the host, so each such key is captured once, lazily, and replayed (vLLM
captures its own eagle drafting the same way). Batches are padded up to
capture sizes (1, 2, 4, then multiples of 8) by repeating the last request;
keys read are rounded up to a power of two. The graphs share one memory pool
and are replayed one at a time; their outputs are read before the next.
If a capture fails the runtime logs why and drafts eagerly from then on.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vllm_specplug.verification.backend import next_power_of_2
from vllm_specplug.verification.metadata import DraftTree

logger = logging.getLogger("vllm_specplug.head_graphs")

BATCH_STEP = 8  # capture sizes above 4 requests: multiples of this
MIN_KEYS = 64  # smallest keys-read bucket
MAX_GRAPHS = 256  # oldest graphs are dropped past this


def padded_batch(num_requests: int) -> int:
    if num_requests <= 4:
        return next_power_of_2(num_requests)
    return -(-num_requests // BATCH_STEP) * BATCH_STEP


def keys_bucket(num_keys: int, capacity: int) -> int:
    return min(capacity, max(MIN_KEYS, next_power_of_2(num_keys)))


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    slots: torch.Tensor  # [Bp] int64, static input
    root_token_ids: torch.Tensor  # [Bp] int64, static input
    root_positions: torch.Tensor  # [Bp] int64, static input
    tree: DraftTree  # [Bp, N] static outputs


def _padded(values: torch.Tensor, size: int) -> torch.Tensor:
    """[B] -> [size], the last entry repeated."""
    return torch.cat([values, values[-1:].expand(size - values.shape[0])])


class DraftGraphs:
    def __init__(self, draft_pass: Callable[..., DraftTree]) -> None:
        """draft_pass(slots, root_token_ids, root_positions, num_keys, topk,
        num_steps, num_draft_tokens) -> DraftTree, all shapes fixed by its
        inputs' sizes and the ints."""
        self.draft_pass = draft_pass
        self.graphs: dict[tuple, _Captured] = {}
        self.version = None  # the pool's tensors the graphs read
        self.memory_pool = None
        self.disabled = False

    def run(self, pool, slots: np.ndarray, root_token_ids: torch.Tensor,
            root_positions: torch.Tensor, num_keys: int, shape: tuple[int, int, int]
            ) -> DraftTree:
        num_keys = keys_bucket(num_keys, pool.capacity)
        slot_ids = torch.from_numpy(slots).to(pool.device)
        if self.disabled:
            return self.draft_pass(slot_ids, root_token_ids, root_positions, num_keys, *shape)
        if pool.version != self.version:  # reallocated: the captured addresses are stale
            # A fresh memory pool too: capturing into the pool of the graphs just
            # freed hit an allocator assert on an H100 (docs/results/tree_cuda_h100_graphs).
            self.graphs.clear()
            self.memory_pool = None
            self.version = pool.version
        batch, size = len(slots), padded_batch(len(slots))
        inputs = [_padded(t, size) for t in (slot_ids, root_token_ids, root_positions)]
        key = (size, num_keys, shape)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self._capture(key, inputs)
            if captured is None:
                return self.draft_pass(slot_ids, root_token_ids, root_positions, num_keys,
                                       *shape)
        for static, value in zip((captured.slots, captured.root_token_ids,
                                  captured.root_positions), inputs):
            static.copy_(value)
        captured.graph.replay()
        return DraftTree(**{f.name: getattr(captured.tree, f.name)[:batch]
                            for f in dataclasses.fields(DraftTree)})

    def _capture(self, key: tuple, inputs: list[torch.Tensor]) -> _Captured | None:
        size, num_keys, shape = key
        static = [t.clone() for t in inputs]
        try:
            if self.memory_pool is None:
                self.memory_pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compiles kernels, sets up cuBLAS: not capturable
                self.draft_pass(*static, num_keys, *shape)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of vLLM's other threads do not void the capture
            with torch.cuda.graph(graph, pool=self.memory_pool,
                                  capture_error_mode="thread_local"):
                tree = self.draft_pass(*static, num_keys, *shape)
        except Exception as error:  # noqa: BLE001 - drafting goes on, eagerly
            logger.warning("vllm-specplug: capturing a drafting pass as a CUDA graph "
                           "failed (%s: %s); drafting eagerly from now on",
                           type(error).__name__, error)
            self.disabled = True
            self.graphs.clear()
            return None
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        captured = _Captured(graph, *static, tree)
        self.graphs[key] = captured
        logger.debug("vllm-specplug: captured a drafting pass for %s", key)
        return captured
