"""What the first rank of a sharded target decides for every rank.

With `tensor_parallel_size` > 1 each rank runs our drafter beside its shard
of the target. Whatever a rank decides from its own clock or its own host
work can differ between ranks, and the ranks must feed one sharded forward
the same tokens and the same tree layout. So the first rank of the
tensor-parallel group decides, and a broadcast over the group hands its
decision to the others:
- Model Runner V2: the host proposers' padded [num_reqs, K] drafts
  (integration/v2/speculator.py);
- the V1 runner: the tree budget's node counts per request, which the
  first rank sizes from its own step times (integration/v1/tree_drafter.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FirstRankShare:
    """`decides_here`: this rank is the first of its tensor-parallel group;
    `broadcast` (collective, in place) sends the first rank's tensor to the
    others: every rank calls it with a tensor of the same shape and dtype."""

    decides_here: bool
    broadcast: Callable[[torch.Tensor], None]


def first_rank_share(vllm_config) -> FirstRankShare | None:
    """None for a target on one rank; else this rank's share over vLLM's
    tensor-parallel group (built in the worker, after vLLM set up its groups;
    on CPU the group's backend is gloo, on CUDA NCCL)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return FirstRankShare(group.is_first_rank, lambda tensor: group.broadcast(tensor, src=0))
