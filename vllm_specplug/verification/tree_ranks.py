"""Each kept node's rank by path score in an EAGLE-2 draft tree (arXiv
2406.16858): which nodes a smaller tree drafted from the same pool keeps.
Taken by the head's drafting pass only where the batch policy reads them
(`HeadRuntime.rank_nodes`): B x (N - 1)^2 comparisons a pass."""
from __future__ import annotations

import torch

from vllm_specplug.verification.metadata import NO_NODE


def score_ranks(scores: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
    """[B, N] rank of each kept node by path score (root NO_NODE), ties to
    the earlier candidate, as the selection's stable sort orders them: the
    tree of k + 1 nodes drafted from the same pool keeps the nodes of rank
    < k (EAGLE-2's selection of the best k). A child's score never exceeds
    its parent's, and on a tie the parent is the earlier candidate, so ranks
    rise along a path: the accepted path's nodes of rank < k are what the
    smaller tree would have accepted (the batch policy learns every size
    from one, adaptive/length_acceptance.py). N - 1 <= 63 kept nodes, so
    the pairwise comparison is small.

    Args:
        scores: [B, C] the pool's path scores.
        cand_ids: [B, N] the candidate of each node (root NO_NODE).
    """
    kept = cand_ids[:, 1:]
    mine = scores.gather(1, kept)
    before = (mine[:, :, None] > mine[:, None, :]) | (
        (mine[:, :, None] == mine[:, None, :]) & (kept[:, :, None] < kept[:, None, :]))
    ranks = before.sum(dim=1)  # [B, N - 1]: kept nodes placed before each
    return torch.cat([torch.full_like(cand_ids[:, :1], NO_NODE), ranks], dim=1)
