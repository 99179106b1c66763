"""Rows of a request out of the hidden-state cache: plain torch, any device."""
from __future__ import annotations

import torch


def gather_rows(kv_cache: torch.Tensor, block_ids: list[int], block_size: int,
                num_tokens: int) -> torch.Tensor:
    """Rows of the first `num_tokens` slots of `block_ids`, on the cache's device.

    kv_cache: [num_blocks, L, block_size, H] -> returns [num_tokens, L, H].
    """
    blocks = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    slots = (blocks[:, None] * block_size
             + torch.arange(block_size, device=kv_cache.device)).flatten()[:num_tokens]
    return kv_cache[slots // block_size, :, slots % block_size]
