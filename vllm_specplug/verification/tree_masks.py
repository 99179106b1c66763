"""The ancestor mask of draft trees: the one definition the tree code shares.

A node attends to (and is verified along) its root path: node j is "allowed"
for node i when j is i or an ancestor of i (EAGLE-2's tree attention mask,
Li et al. 2024, arXiv:2406.16858). Parents precede children in every node
list of this project, so row i is row parent(i) plus i itself.

- `ancestor_mask`: the specification, on the host ([T, N] parent ids).
- `verification/tree_build._ancestry_closure`: the engine's device version
  (transitive closure, no loop over nodes), tested against this one.
- `pack_ancestor_mask`: the bit-packed layout the CUDA tree-attention
  kernel reads (`tree_build.pack_mask`'s layout).
"""
from __future__ import annotations

import numpy as np

from vllm_specplug.verification.metadata import MASK_WORD_BITS


def ancestor_mask(parent_ids: np.ndarray, num_nodes: int | None = None) -> np.ndarray:
    """[T, N] int parent ids (-1: the root, or padding past a tree's end) ->
    [T, N', N'] bool (N' = num_nodes, default N; extra rows/columns False
    except the diagonal), [t, i, j] when node j is node i or its ancestor."""
    parents = np.asarray(parent_ids, dtype=np.int64).reshape(len(parent_ids), -1)
    size = parents.shape[1] if num_nodes is None else num_nodes
    padded = np.full((len(parents), size), -1, dtype=np.int64)
    padded[:, :parents.shape[1]] = parents[:, :size]
    mask = np.zeros((len(parents), size, size), dtype=bool)
    trees = np.arange(len(parents))
    for i in range(size):  # vectorised over trees; parents precede children
        has_parent = padded[:, i] >= 0
        mask[has_parent, i] = mask[trees[has_parent], padded[has_parent, i]]
        mask[:, i, i] = True
    return mask


def pack_ancestor_mask(parent_ids: list[np.ndarray], max_nodes: int,
                       num_words: int) -> np.ndarray:
    """Packed ancestor masks of trees of different sizes: [T, max_nodes,
    num_words] int32, bit j%32 of word j//32 of row i set when node j is i
    or an ancestor of i."""
    parents = np.full((len(parent_ids), max_nodes), -1, dtype=np.int64)
    for t, p in enumerate(parent_ids):
        parents[t, :len(p)] = p
    mask = np.zeros((len(parent_ids), max_nodes, num_words * MASK_WORD_BITS), dtype=bool)
    mask[:, :, :max_nodes] = ancestor_mask(parents)
    return np.packbits(mask, axis=-1, bitorder="little").view("<i4").astype(np.int32)
