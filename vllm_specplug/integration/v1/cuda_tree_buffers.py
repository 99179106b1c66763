"""The V1 runner's CUDA tree-attention rows: per-request-row tree metadata of
the current step in persistent device buffers, written from the host layout
(`tree_step.py`) once per step, read by our kernel inside the captured
forward (`integration/cuda_tree_attention.py`). Model Runner V2 writes the
same rows on the device instead (`integration/v2/tree_slots.py`).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.integration.v1.tree_step import TreeStep
from vllm_specplug.verification.metadata import MASK_WORD_BITS
from vllm_specplug.verification.tree_attention import TreeAttentionMetadata
from vllm_specplug.verification.tree_masks import pack_ancestor_mask


class TreeAttentionBuffers:
    """Per-request-row tree metadata of the current step, on the device, at
    fixed addresses (host mirrors written, then copied: four small copies per
    step, of the rows in use)."""

    def __init__(self, max_num_reqs: int, max_nodes: int, device) -> None:
        words = -(-max_nodes // MASK_WORD_BITS)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int32)
        self.host = TreeAttentionMetadata(zeros(max_num_reqs), zeros(max_num_reqs),
                                          zeros(max_num_reqs),
                                          zeros(max_num_reqs, max_nodes, words))
        self.metadata = TreeAttentionMetadata(*(t.to(device) for t in vars(self.host).values()))
        self.num_masked = 0
        self.masked_steps = 0  # steps that had a non-chain tree (tests, benchmarks)
        self.compiled: set[tuple] = set()  # layer shapes the kernel has been launched for
        self._rows_dirty = 0  # rows that may hold a tree: cleared on the next update

    @property
    def max_num_reqs(self) -> int:
        return self.host.num_nodes.shape[0]

    def update(self, step: TreeStep) -> None:
        """Write the step's non-chain trees (rows of the runner's batch)."""
        masked = step.masked()
        # rows that held a tree last step, or get one now: every other row is
        # already zero on the device (chain-only steps copy nothing)
        rows = max(self._rows_dirty, 1 + max((r.row for r in masked), default=-1))
        host = self.host
        for tensor in vars(host).values():
            tensor[:rows] = 0
        if masked:
            index = torch.tensor([r.row for r in masked])
            host.first_token[index] = torch.tensor([r.first_token for r in masked],
                                                   dtype=torch.int32)
            host.seq_lens[index] = torch.tensor([r.seq_len for r in masked], dtype=torch.int32)
            host.num_nodes[index] = torch.tensor([r.num_nodes for r in masked],
                                                 dtype=torch.int32)
            words = pack_ancestor_mask([r.parent_ids for r in masked], host.max_nodes,
                                       host.ancestor_bits.shape[2])
            host.ancestor_bits[index] = torch.from_numpy(words)
        if rows:
            for name, tensor in vars(self.metadata).items():
                tensor[:rows].copy_(getattr(host, name)[:rows])
        self._rows_dirty = 1 + max((r.row for r in masked), default=-1)
        self.num_masked = len(masked)
        self.masked_steps += bool(masked)


