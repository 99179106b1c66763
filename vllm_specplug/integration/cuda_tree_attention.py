"""Tree attention on vLLM's CUDA attention backends (FlashAttention and
Triton; FlexAttention is not wrapped), and KV compaction in their cache layout.

The backend's kernel runs first (it writes every token's K/V at its
sequential slot and attends causally); then our kernel (`kernels/
tree_attention.py`) rewrites the rows of this step's non-chain trees. Its
inputs live in persistent buffers (`TreeAttentionBuffers`), filled once per
step by the runner patch, so the launch can be captured in a FULL CUDA graph:
at replay the kernel reads the step's trees from the same addresses (each
attention layer's impl holds the buffers: `attach`), and
rows without a tree (chains, requests without drafts, batch padding) have
`num_nodes = 0`, which the kernel skips.

Every vLLM 0.32 CUDA backend gives a layer's cache in one logical order,
[num_blocks, num_kv_heads, block_size, 2 * head_size], and splits it with
`kv_cache.transpose(1, 2).split(head_size, -1)`; we read it the same way.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.integration.tree_attention import check_supported
from vllm_specplug.integration.tree_step import TreeStep
from vllm_specplug.verification.metadata import MASK_WORD_BITS
from vllm_specplug.verification.tree_attention import (TreeAttentionMetadata,
                                                       tree_attention_triton)

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
            words = ancestor_words([r.parent_ids for r in masked], host.max_nodes,
                                   host.ancestor_bits.shape[2])
            host.ancestor_bits[index] = torch.from_numpy(words)
        if rows:
            for name, tensor in vars(self.metadata).items():
                tensor[:rows].copy_(getattr(host, name)[:rows])
        self._rows_dirty = 1 + max((r.row for r in masked), default=-1)
        self.num_masked = len(masked)
        self.masked_steps += bool(masked)


def ancestor_words(parent_ids: list[np.ndarray], max_nodes: int, num_words: int) -> np.ndarray:
    """Packed ancestor masks of several trees at once: [T, max_nodes,
    num_words] int32, bit j%32 of word j//32 of row i set when node j is i or
    an ancestor of i (the layout of `pack_mask`). One vectorised pass per
    depth-ordered node index instead of a Python loop per request."""
    parents = np.full((len(parent_ids), max_nodes), -1, dtype=np.int64)
    for t, p in enumerate(parent_ids):
        parents[t, :len(p)] = p
    mask = np.zeros((len(parent_ids), max_nodes, num_words * MASK_WORD_BITS), dtype=bool)
    trees = np.arange(len(parent_ids))
    for i in range(max_nodes):
        has_parent = parents[:, i] >= 0
        mask[has_parent, i] = mask[trees[has_parent], parents[has_parent, i]]
        mask[:, i, i] = True
    return np.packbits(mask, axis=-1, bitorder="little").view("<i4").astype(np.int32)


DECODER = "decoder"  # vLLM's AttentionType.DECODER: self-attention over the request's tokens
TREE_ROWS_ATTR = "specplug_tree_rows"  # set on each attention impl by `attach`


def attach(layers: dict, buffers) -> int:
    """Tree attention in these attention layers (vLLM's static forward
    context: name -> layer): each layer's impl reads `buffers` (a
    `TreeAttentionBuffers`, or Model Runner V2's `TreeSlots`); None turns it
    off. Returns how many layers were attached."""
    count = 0
    for layer in layers.values():
        impl = getattr(layer, "impl", None)
        if impl is not None:
            setattr(impl, TREE_ROWS_ATTR, buffers)
            count += 1
    return count


def attached(layers: dict):
    """The buffers the first attention layer reads (None: tree attention off)."""
    impl = next((getattr(m, "impl") for m in layers.values() if hasattr(m, "impl")), None)
    return getattr(impl, TREE_ROWS_ATTR, None)


def after_backend_forward(impl, query, kv_cache, attn_metadata, output) -> None:
    """Called after a CUDA backend's `forward`: tree rows get tree attention.
    Launched during CUDA-graph capture even with no tree (the graph must
    contain the launch for the steps it will replay)."""
    buffers = getattr(impl, TREE_ROWS_ATTR, None)
    if (buffers is None or attn_metadata is None or kv_cache is None
            or getattr(impl, "attn_type", DECODER) != DECODER):
        return
    # The first launch per layer shape compiles the kernel: let it happen in
    # vLLM's warm-up runs, never inside a stream capture.
    key = (query.dtype, kv_cache.dtype, impl.num_heads, impl.num_kv_heads, impl.head_size,
           kv_cache.shape[2])
    if (buffers.num_masked == 0 and key in buffers.compiled
            and not torch.cuda.is_current_stream_capturing()):
        return
    buffers.compiled.add(key)
    check_supported(impl)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    num_reqs = min(attn_metadata.block_table.shape[0], buffers.max_num_reqs)
    tree_attention_triton(query.view(-1, impl.num_heads, impl.head_size), key_cache,
                          value_cache, attn_metadata.block_table, buffers.metadata,
                          impl.scale, output.view(-1, impl.num_heads, impl.head_size),
                          num_requests=num_reqs)


def move_cached_tokens(kv_cache: torch.Tensor, src_slots: torch.Tensor,
                       dst_slots: torch.Tensor) -> None:
    """KV compaction in the CUDA backends' layout: the K/V of the tokens at
    `src_slots` [S] move to `dst_slots` [S] (all read before any write)."""
    by_slot = kv_cache.transpose(1, 2)  # [num_blocks, block_size, kv_heads, 2 * head_size]
    block_size = by_slot.shape[1]
    rows = by_slot[src_slots // block_size, src_slots % block_size]
    by_slot[dst_slots // block_size, dst_slots % block_size] = rows
