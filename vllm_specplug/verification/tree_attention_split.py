"""Split tree attention: FlashAttention over each request's prefix, our
kernel over this step's tokens, merged by log-sum-exp.

The first way (`tree_attention.py`) lets the backend attend causally over
every key, then recomputes each tree row over every key again: a tree step
reads its requests' whole cache twice per layer. Here the backend's kernel
(FlashAttention, `flash_prefix_attention` in patches/flash_attn.py)
attends every query row to the prefix only (keys cached before the step's
first query token, no mask) and returns its log-sum-exp; then
`tree_part_attention` attends each row to its request's query tokens (at
most the tree's node count) under the tree mask, causally for requests
without a tree, and merges the two parts in place, as split-K attention
combines its splits (FlashDecoding, arXiv 2311.01282; vLLM's cascade and
context-parallel attention merge with `merge_attn_states` the same way).
The cache is read once; the tree part reads N keys per request.

Shapes: query / output [T, num_heads, head_size]; key_cache / value_cache
[num_blocks, block_size, num_kv_heads, head_size] (vLLM's CUDA split of its
logical layout); block_table [B, max_blocks] int32; query_start_loc [B + 1]
int32; seq_lens [B] int32 (cached + this step's tokens); lse [num_heads, T]
float32 (any strides), natural log, -inf where a row has no prefix.
Kernel: `kernels/tree_part_attention.py`.
"""
from __future__ import annotations

import torch

from vllm_specplug.verification.backend import next_power_of_2, triton_interpreted
from vllm_specplug.verification.tree_attention import MIN_DOT, unpack_bits

MAX_ROW_TILE = 64  # query rows (tokens x heads of one KV group) per program


def _request_keys(key_cache, value_cache, block_table, b: int, positions, group: int):
    blocks = block_table[b, positions // key_cache.shape[1]].long()
    offsets = positions % key_cache.shape[1]
    keys = key_cache[blocks, offsets].float().repeat_interleave(group, 1)
    values = value_cache[blocks, offsets].float().repeat_interleave(group, 1)
    return keys, values  # [L, num_heads, head_size] each


def prefix_attention_reference(query, key_cache, value_cache, block_table, query_start_loc,
                               prefix_lens, scale: float, output) -> torch.Tensor:
    """What FlashAttention is asked in the split path (the plain-PyTorch
    specification, float32 math): every query row of request b attends,
    unmasked, to its first prefix_lens[b] keys; writes `output` rows and
    returns the log-sum-exp [num_heads, T] (-inf and zeros without prefix)."""
    group = query.shape[1] // key_cache.shape[2]
    lse = torch.full((query.shape[1], query.shape[0]), float("-inf"),
                     dtype=torch.float32, device=query.device)
    for b in range(prefix_lens.shape[0]):
        first, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        prefix = int(prefix_lens[b])
        if end <= first:
            continue
        if prefix <= 0:
            output[first:end] = 0
            continue
        positions = torch.arange(prefix, device=query.device)
        keys, values = _request_keys(key_cache, value_cache, block_table, b, positions, group)
        scores = torch.einsum("nhd,lhd->hnl", query[first:end].float(), keys) * scale
        lse[:, first:end] = scores.logsumexp(-1)
        output[first:end] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1),
                                         values).to(output.dtype)
    return lse


def tree_part_attention_reference(query, key_cache, value_cache, block_table, query_start_loc,
                                  seq_lens, tree_nodes, ancestor_bits, scale: float, output,
                                  lse) -> None:
    """Plain-PyTorch specification of `tree_part_attention` (in place):
    request b's rows attend to its own query tokens (tree mask where
    tree_nodes[b] > 0, causal otherwise) and are merged with the prefix
    part already in `output`, weighted by `lse`."""
    group = query.shape[1] // key_cache.shape[2]
    for b in range(seq_lens.shape[0]):
        first, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        n = end - first
        prefix = int(seq_lens[b]) - n
        if n <= 0 or prefix < 0:
            continue
        keys, values = _request_keys(key_cache, value_cache, block_table, b,
                                     torch.arange(prefix, prefix + n, device=query.device),
                                     group)
        is_tree = b < tree_nodes.shape[0] and int(tree_nodes[b]) > 0
        visible = (unpack_bits(ancestor_bits[b, :n], n) if is_tree else
                   torch.ones(n, n, dtype=torch.bool, device=query.device).tril())
        scores = torch.einsum("nhd,lhd->hnl", query[first:end].float(), keys) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        tree_lse = scores.logsumexp(-1)  # [H, n]
        tree_out = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)
        prefix_lse = lse[:, first:end] if prefix > 0 else torch.full_like(tree_lse,
                                                                          float("-inf"))
        total = torch.logaddexp(prefix_lse, tree_lse)
        prefix_weight = (prefix_lse - total).exp().T[..., None]  # [n, H, 1]
        tree_weight = (tree_lse - total).exp().T[..., None]
        output[first:end] = (prefix_weight * output[first:end].float()
                             + tree_weight * tree_out).to(output.dtype)


def tree_part_attention_triton(query, key_cache, value_cache, block_table, query_start_loc,
                               seq_lens, tree_nodes, ancestor_bits, scale: float, output,
                               lse, max_query_len: int | None = None,
                               num_warps: int = 4) -> None:
    """Launch over every request of `seq_lens` (padding rows, whose prefix
    would be negative, are skipped in the kernel); requests at or past
    tree_nodes' rows are chains. At most `max_query_len` query tokens per
    request (default and limit: the tree's node count,
    `ancestor_bits.shape[1]`): the tiles cover that many, so a step of
    3-token queries does not pay for 16-node tiles."""
    from vllm_specplug.kernels.tree_part_attention import tree_part_attention_kernel

    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_nodes = ancestor_bits.shape[1]
    most = max_nodes if max_query_len is None else min(max_query_len, max_nodes)
    block_m = min(MAX_ROW_TILE, max(MIN_DOT, next_power_of_2(most * group)))
    row_tiles = -(-most * group // block_m)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    tree_part_attention_kernel[(seq_lens.shape[0], num_kv_heads, row_tiles)](
        query, key_cache, value_cache, output, lse, block_table, query_start_loc, seq_lens,
        tree_nodes, ancestor_bits, scale, tree_nodes.shape[0],
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        lse.stride(0), lse.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), max_nodes, ancestor_bits.shape[2], head_size,
        GROUP=group, HEAD_PAD=max(MIN_DOT, next_power_of_2(head_size)),
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=block_m,
        BLOCK_N=max(MIN_DOT, next_power_of_2(most)), PRECISION=precision,
        UPCAST=triton_interpreted(), num_warps=num_warps)


def prefix_lens_of(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[B] int32: keys cached before each request's first query token
    (0 for padding rows, whose query is empty or whose seq_len is 0)."""
    num_query = query_start_loc[1:seq_lens.shape[0] + 1] - query_start_loc[:seq_lens.shape[0]]
    return (seq_lens - num_query).clamp_min_(0).to(torch.int32)
