"""Prefix-cache hits for the EAGLE-3/MTP head on the V1 runner.

vLLM's `eagle3` keeps its draft KV in the target's paged blocks, so a request
whose prompt starts on cached blocks finds its drafter's KV there too. Our
head keeps its KV per request (`HeadCachePool`); `HeadBlockStore` keeps its
rows of each full block by block id, saved as soon as the head covers the
block (on this runner the host knows every verified position), and a
request new to the head whose first position follows such blocks starts
with them. Model Runner V2's counterpart is `v2/prefix_blocks.py`.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.proposers.eagle3_head import HeadRuntime
from vllm_specplug.proposers.head_cache import NO_POSITION, HeadBlockStore


class V1PrefixRows:
    def __init__(self) -> None:
        self.block_store = HeadBlockStore()

    def adopt(self, head: HeadRuntime, req_id: str, table, row: int, first: int,
              token_ids: np.ndarray) -> None:
        """A request new to the head whose first position follows blocks that
        vLLM's prefix cache supplied gets the head's rows of those blocks;
        `token_ids`: its tokens (the prefix's last row is kept where the
        request that saved it had the same token at `first`)."""
        size = table.block_size
        if (first == 0 or first % size or head.pool is None
                or head.last_position(req_id) != NO_POSITION):
            return
        rows = self.block_store.gather(table.block_table.np[row, :first // size],
                                       int(token_ids[first]))
        if rows is not None:
            head.pool.adopt(req_id, *rows)

    def store(self, head: HeadRuntime, req_ids: list[str], batch_rows: list[int],
              positions: list[np.ndarray], table, token_ids: np.ndarray) -> None:
        """Blocks written this step lose their stored rows (a new owner);
        those the request's head cache now covers whole are stored, with
        the token after each one's last row (`token_ids` [rows, max_len])."""
        size, pool = table.block_size, head.pool
        for req_id, row, pos in zip(req_ids, batch_rows, positions):
            blocks, first = table.block_table.np[row], int(pos[0]) // size
            self.block_store.drop(blocks[first:int(pos[-1]) // size + 1])
            slot = pool.slot_of[req_id]
            last = (head.last_position(req_id) + 1) // size
            if last <= first:  # no block completed this step
                continue
            span = slice(first * size, last * size)
            next_ids = token_ids[row, (first + 1) * size:last * size + 1:size]
            self.block_store.save_blocks(blocks[first:last], pool.keys[slot, :, span],
                                         pool.values[slot, :, span],
                                         next_ids=torch.from_numpy(next_ids.astype(np.int64)))
