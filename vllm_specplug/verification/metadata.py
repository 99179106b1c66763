"""Metadata of draft trees and verification results.

Shapes use B = requests, C = draft candidates, N = tree nodes including the
root (`num_draft_tokens`), V = vocabulary. A tree's node 0 is the root: the
last verified token, whose KV is not yet in the cache; it sits at position
`seq_len` and node i at `seq_len + depth[i]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NO_NODE = -1  # parent of the root; "no child" / "no sibling"; padding of node lists
PLACEHOLDER_TOKEN_ID = -1  # padding of output token lists (vLLM's convention)
ROOT_PARENT = -1  # in candidate pools: the candidate hangs off the root
MASK_WORD_BITS = 32


@dataclass
class DraftCandidates:
    """Every token the draft proposed, pooled over all draft steps.

    Scores are path log-probabilities (sum of the draft's log-probs from the
    root), so a child never scores above its parent and the best-scoring set
    is closed under ancestors (EAGLE-2, arXiv 2406.16858).
    """
    token_ids: torch.Tensor  # [B, C] int64
    scores: torch.Tensor  # [B, C] float32
    parent_ids: torch.Tensor  # [B, C] int64, index into C or ROOT_PARENT


@dataclass
class DraftTree:
    """A draft tree of N nodes per request, parents before children."""
    token_ids: torch.Tensor  # [B, N] int64, node 0 = root token
    parent_ids: torch.Tensor  # [B, N] int64, NO_NODE for the root
    cand_ids: torch.Tensor  # [B, N] int64, candidate each node came from (root: NO_NODE)
    depths: torch.Tensor  # [B, N] int64, root 0
    positions: torch.Tensor  # [B, N] int64, seq_len + depth
    attn_mask: torch.Tensor  # [B, N, N] bool, [i, j]: j is i or an ancestor of i
    packed_mask: torch.Tensor  # [B, N, ceil(N/32)] int32, bit j%32 of word j//32
    first_child_ids: torch.Tensor  # [B, N] int64, NO_NODE if a leaf
    next_sibling_ids: torch.Tensor  # [B, N] int64, NO_NODE if the last child
    # [B, N] int64, each node's rank by path score among the kept nodes (root
    # NO_NODE): EAGLE-2's tree of k + 1 nodes keeps those of rank < k, so a
    # path's ranks rise. None unless the drafter was asked for them
    # (`HeadRuntime.rank_nodes`, tree_ranks.py)
    score_ranks: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]


@dataclass
class VerifyOutput:
    """What verification emits per request: accepted drafts then one more."""
    output_token_ids: torch.Tensor  # [B, N] int64, accepted drafts + bonus/recovered, PLACEHOLDER_TOKEN_ID-padded
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens (root excluded)
    accepted_node_ids: torch.Tensor  # [B, N] int64, root..last accepted node, NO_NODE-padded

    @property
    def num_output_tokens(self) -> torch.Tensor:
        return self.num_accepted + 1


def empty_verify_output(batch: int, num_nodes: int, device) -> VerifyOutput:
    return VerifyOutput(
        output_token_ids=torch.full((batch, num_nodes), PLACEHOLDER_TOKEN_ID,
                                    dtype=torch.long, device=device),
        num_accepted=torch.zeros(batch, dtype=torch.long, device=device),
        accepted_node_ids=torch.full((batch, num_nodes), NO_NODE,
                                     dtype=torch.long, device=device))
