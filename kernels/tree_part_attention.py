"""Triton kernel: the tree part of split tree attention, merged with the
prefix part by log-sum-exp.

Wrapper and reference: `vllm_specplug/verification/tree_attention_split.py`.
FlashAttention has already written, for every query row, its attention over
the request's prefix (the keys cached before this step's first query token)
into `out`, with its log-sum-exp. This kernel attends each row to the keys of
its own request's query tokens (this step's tokens, already in the paged
cache at their sequential slots) under the tree mask (bit j of the row's
ancestor words: node j is the row's node or above it), or causally for a
request without a tree (a chain, a plain decode, a short prefill chunk), and
merges the two parts in place (as FlashAttention's split-K combine and
vLLM's `merge_attn_states` do; FlashDecoding, arXiv 2311.01282).

Grid (requests, KV heads, row tiles). A program holds BLOCK_M rows: row m
is query token m // GROUP of its request, query head kv_head * GROUP +
m % GROUP; the request's query tokens are at most BLOCK_N keys, one tile.
"""
import triton
import triton.language as tl

from vllm_specplug.kernels.tree_attention import load_paged_kv

WORD_BITS = tl.constexpr(32)


@triton.jit
def _tree_visible(bits_ptr, node, j, num_tree_keys, row_live, key_live, NUM_WORDS):
    """[BLOCK_M, BLOCK_N] bool: this step's key j is visible to query token
    `node`: its ancestor bit for trees (num_tree_keys > 0: the request's
    node count), j <= node otherwise."""
    pair_live = row_live[:, None] & key_live[None, :]
    in_tree = pair_live & (j < num_tree_keys)[None, :]
    words = tl.load(bits_ptr + node[:, None] * NUM_WORDS + j[None, :] // WORD_BITS,
                    mask=in_tree, other=0)
    ancestor = ((words >> (j[None, :] % WORD_BITS)) & 1) != 0
    causal = (j[None, :] <= node[:, None]) & (num_tree_keys == 0)
    return pair_live & (ancestor | causal)


# `lse_stride_h` is the step's token count (the log-sum-exp is [H, T]): a
# static tree's engine captures only multiples of its node count, so a step
# of another count (a request's last steps, drafts cut to its max_tokens)
# compiled a second variant in service (SmolLM2 bf16 on the H200,
# docs/results/batch_draft_length_h200_run14); it and the row count only
# offset scalar loads, so their divisibility buys no vector loads
@triton.jit(do_not_specialize=["num_tree_rows", "lse_stride_h", "lse_stride_t"])
def tree_part_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
                               block_table_ptr, query_start_ptr, seq_len_ptr,
                               tree_nodes_ptr, bits_ptr, scale, num_tree_rows,
                               q_stride_t, q_stride_h, out_stride_t, out_stride_h,
                               lse_stride_h, lse_stride_t,
                               k_stride_b, k_stride_s, k_stride_h,
                               v_stride_b, v_stride_s, v_stride_h, block_table_stride,
                               NUM_NODES, NUM_WORDS, HEAD_SIZE,
                               GROUP: tl.constexpr, HEAD_PAD: tl.constexpr,
                               BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                               UPCAST: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    first = tl.load(query_start_ptr + b).to(tl.int64)
    num_query = tl.load(query_start_ptr + b + 1) - first
    prefix = tl.load(seq_len_ptr + b) - num_query  # < 0: a padding row, skipped
    tree_nodes = tl.load(tree_nodes_ptr + tl.minimum(b, num_tree_rows - 1))
    # scalar conditions become row counts, so every mask is a comparison
    num_rows = tl.where(prefix >= 0, num_query, 0)
    num_prefixed = tl.where(prefix > 0, num_rows, 0)
    num_tree_keys = tl.where((b < num_tree_rows) & (tree_nodes > 0), num_rows, 0)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    node = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_live = node < num_rows
    d = tl.arange(0, HEAD_PAD)
    d_live = d < HEAD_SIZE
    tile = row_live[:, None] & d_live[None, :]
    q = tl.load(q_ptr + (first + node)[:, None] * q_stride_t + head[:, None] * q_stride_h
                + d[None, :], mask=tile, other=0.0)
    j = tl.arange(0, BLOCK_N)
    key_live = j < num_rows
    k, v = load_paged_kv(k_cache_ptr, v_cache_ptr, block_table_ptr + b * block_table_stride,
                         prefix + j, key_live, kv_head, d, d_live, k_stride_b, k_stride_s,
                         k_stride_h, v_stride_b, v_stride_s, v_stride_h, BLOCK_SIZE)
    if UPCAST:  # the Triton interpreter's bf16 dot is wrong: compute in float32
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = _tree_visible(bits_ptr + b * NUM_NODES * NUM_WORDS, node, j, num_tree_keys,
                            row_live, key_live, NUM_WORDS)
    scores = tl.where(visible, scores, float("-inf"))
    # every live row sees its own token: a finite max; dead rows get 0
    tree_max = tl.where(row_live, tl.max(scores, axis=1), 0.0)
    p = tl.where(visible, tl.exp(scores - tree_max[:, None]), 0.0)
    tree_sum = tl.sum(p, axis=1)
    tree_acc = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    # the prefix part: FlashAttention's normalised output and log-sum-exp
    has_prefix = node < num_prefixed
    out_rows = out_ptr + (first + node)[:, None] * out_stride_t + head[:, None] * out_stride_h
    prefix_out = tl.load(out_rows + d[None, :], mask=has_prefix[:, None] & d_live[None, :],
                         other=0.0).to(tl.float32)
    prefix_lse = tl.load(lse_ptr + head * lse_stride_h + (first + node) * lse_stride_t,
                         mask=has_prefix, other=float("-inf"))
    top = tl.maximum(prefix_lse, tree_max)
    prefix_weight = tl.where(has_prefix, tl.exp(prefix_lse - top), 0.0)
    tree_weight = tl.exp(tree_max - top)
    total = prefix_weight + tree_weight * tree_sum
    merged = (prefix_weight[:, None] * prefix_out + tree_weight[:, None] * tree_acc) \
        / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_rows + d[None, :], merged.to(out_ptr.dtype.element_ty), mask=tile)
