"""Draft trees per state slot of Model Runner V2, and the step's verification.

The head speculator drafts a tree for a request at the end of a step; the
next step's model state lays it out (positions, tree-attention rows), the
tree sampler verifies it and compacts the accepted path's KV, and the
speculator ingests that path. All of it stays on the device: trees are kept
per state slot (`idx_mapping[b]`), accepted paths per batch row. One object,
made by the speculator and handed to the model state when the target is
loaded (patches/gpu_v2_model_runner.py), carries it between them.
"""
from __future__ import annotations

import torch

from vllm_specplug.verification.kv_compaction import KVLayers, kv_layers
from vllm_specplug.verification.metadata import MASK_WORD_BITS, NO_NODE, DraftTree
from vllm_specplug.verification.tree_attention import TreeAttentionMetadata
from vllm_specplug.verification.tree_build import pack_mask


class TreeSlots:
    def __init__(self, max_num_reqs: int, num_nodes: int, device) -> None:
        node = torch.arange(num_nodes, device=device)
        chain = torch.tril(torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=device))
        self.num_nodes = num_nodes
        # per state slot: the tree drafted last (a chain until one is drafted)
        self.parents = (node - 1).repeat(max_num_reqs, 1)  # [S, N] int64
        self.depths = node.to(torch.int32).repeat(max_num_reqs, 1)  # [S, N] int32
        self.bits = pack_mask(chain[None]).repeat(max_num_reqs, 1, 1)  # [S, N, W] int32
        self.is_tree = torch.zeros(max_num_reqs, dtype=torch.int8, device=device)  # [S]
        # each node's rank by path score (DraftTree.score_ranks; a chain's
        # node i: i - 1): what the batch policy learns smaller trees from;
        # kept only once asked for (`keep_ranks`)
        self.ranks: torch.Tensor | None = None  # [S, N] int64
        # nodes of each slot's last tree, root included: verification reads none past it
        self.num_drafted = torch.full((max_num_reqs,), num_nodes, dtype=torch.int32,
                                      device=device)  # [S]
        # per batch row, written by the tree sampler: root .. last accepted node
        self.accepted_nodes = torch.full((max_num_reqs, num_nodes), NO_NODE,
                                         dtype=torch.int64, device=device)  # [S, N]
        # the persistent rows our tree-attention kernel reads inside the forward
        words = -(-num_nodes // MASK_WORD_BITS)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int32,  # noqa: E731
                                           device=device)
        self.metadata = TreeAttentionMetadata(zeros(max_num_reqs), zeros(max_num_reqs),
                                              zeros(max_num_reqs),
                                              zeros(max_num_reqs, num_nodes, words))
        # FlashAttention 3 layers: prefix by FlashAttention + tree part, merged
        # (integration/cuda_tree_attention.split_forward); set by the speculator
        self.split_attention = False
        self.split_layers = 0  # layer calls that took the split way (tests, benchmarks)
        self.num_masked = 0  # tree rows this step (host count: 0 skips the kernel)
        self.masked_steps = 0  # steps with tree rows (tests, benchmarks)
        self.compiled: set[tuple] = set()  # layer shapes the kernel has been launched for
        # this step's block table ([num_reqs, max_blocks] int32, group 0), for KV compaction
        self.block_table: torch.Tensor | None = None
        # every attention layer's cache as [num_blocks, block_size, kv_heads, 2 * head_size]
        self.kv_caches: list[torch.Tensor] = []
        self.kv_layers: KVLayers | None = None  # the same, for one-launch compaction

    @property
    def max_num_reqs(self) -> int:
        return self.is_tree.shape[0]

    def store(self, slots: torch.Tensor, tree: DraftTree, is_tree: bool) -> None:
        """The trees just drafted for state `slots` [B] (no host sync). A
        tree may have fewer nodes than the slots hold (this step's batch size
        asked for fewer drafts): it fills the first ones, and verification
        reads no node past it (`num_drafted`) nor past what was scheduled."""
        num_nodes, words = tree.num_nodes, tree.packed_mask.shape[2]
        self.num_drafted.index_fill_(0, slots, num_nodes)
        self.parents[:, :num_nodes].index_copy_(0, slots, tree.parent_ids)
        self.depths[:, :num_nodes].index_copy_(0, slots, tree.depths.to(torch.int32))
        self.bits[:, :num_nodes, :words].index_copy_(0, slots, tree.packed_mask)
        self.is_tree.index_fill_(0, slots, int(is_tree))
        if self.ranks is not None:  # (a chain's pass carries none: node i ranks i - 1)
            ranks = tree.score_ranks if tree.score_ranks is not None else tree.depths - 1
            self.ranks[:, :num_nodes].index_copy_(0, slots, ranks)

    def keep_ranks(self) -> None:
        """Keep each stored tree's node ranks from now on (`path_ranks`)."""
        node = torch.arange(self.num_nodes, device=self.parents.device)
        self.ranks = (node - 1).repeat(self.max_num_reqs, 1)

    def path_ranks(self, idx_mapping: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """[num_reqs, N - 1] the ranks of each batch row's accepted nodes past
        the root, in path order, `num_nodes` past its path (after the tree
        sampler wrote `accepted_nodes`, before this step's trees are stored)."""
        accepted = self.accepted_nodes[:num_reqs, 1:]
        ranks = self.ranks[idx_mapping[:num_reqs, None], accepted.clamp(min=0)]
        return torch.where(accepted == NO_NODE, self.num_nodes, ranks)

    def bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """The attention layers' caches, in the CUDA backends' logical layout
        [num_blocks, kv_heads, block_size, 2 * head_size]; compaction moves
        whole slot rows of the physical layout (token-major), which must be
        contiguous."""
        by_slot = [cache.transpose(1, 2) for cache in caches]
        bad = [tuple(c.shape) for c in by_slot if not c.is_contiguous()]
        if bad:
            raise RuntimeError("tree verification needs KV caches laid out per token "
                               f"(FlashAttention/Triton backends); got strides of {bad[0]}")
        self.kv_caches = by_slot
        self.kv_layers = kv_layers(by_slot)

    def forget(self, slots: torch.Tensor) -> None:
        """No tree for these slots: their next drafts (if any) verify as chains."""
        node = torch.arange(self.num_nodes, device=slots.device)
        self.parents.index_copy_(0, slots, (node - 1).expand(slots.shape[0], -1))
        self.depths.index_copy_(0, slots, node.to(torch.int32).expand(slots.shape[0], -1))
        self.is_tree.index_fill_(0, slots, 0)
        self.num_drafted.index_fill_(0, slots, self.num_nodes)
        if self.ranks is not None:
            self.ranks.index_copy_(0, slots, (node - 1).expand(slots.shape[0], -1))
