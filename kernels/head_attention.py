"""Triton kernel: the draft head's attention, read in place from its cache
pool.

Wrapper and reference: `vllm_specplug/proposers/head_attention.py`. Query
row (g, t) of request g attends to the keys of its pool slot (`slots[g]`)
that are valid and at or before its position (`positions[g, t]`; negative:
a padding row, its output 0), then to `num_path` keys of its own (a draft node's
ancestors and itself: `path_k[g, t, :, :num_path]`), in one online softmax
(FlashAttention's running max and sum, arXiv 2205.14135). The einsum path
it replaces first copies every slot's whole cache bucket out of the pool
(at batch 64 on an 8B-shaped head, about 150 MB a copy) and then attends
over the bucket's full length; here each program stops at its rows' last
position.

Grid (requests, KV heads, row tiles). Row m of a tile is query token
m // GROUP, query head kv_head * GROUP + m % GROUP (GQA: the group's heads
share each key tile).
"""
import triton
import triton.language as tl

NEG_START = tl.constexpr(-1.0e30)  # finite running max: the first rescale stays NaN-free


@triton.jit
def _rescale(run_max, run_sum, acc, scores, visible):
    """One online-softmax update: scores [M, N] (visible where the mask
    holds); returns the new max, sum, the rescaled acc and the weights."""
    new_max = tl.maximum(run_max, tl.max(tl.where(visible, scores, NEG_START), axis=1))
    alpha = tl.exp(run_max - new_max)
    # min(., 0): a masked score would overflow exp before the where drops it
    p = tl.where(visible, tl.exp(tl.minimum(scores - new_max[:, None], 0.0)), 0.0)
    return new_max, run_sum * alpha + tl.sum(p, axis=1), acc * alpha[:, None], p


# the counts change from call to call (a bucket, a prompt's length, a path's
# depth): one compiled kernel for all of them, not one per value class. So
# does the positions' row stride (a prefill's rows per request): the prefill
# ingest compiled twice on a served engine's first requests with the same
# constexprs (H200, docs/results/batch_draft_length_h200_run13); it only
# offsets one scalar load per row, so its divisibility buys no vector loads
@triton.jit(do_not_specialize=["num_keys", "num_rows", "num_path", "pos_stride_g"])
def head_attention_kernel(q_ptr, keys_ptr, values_ptr, valid_ptr, slots_ptr, positions_ptr,
                          path_k_ptr, path_v_ptr, out_ptr, scale, num_keys, num_rows, num_path,
                          q_stride_g, q_stride_t, q_stride_h,
                          pool_stride_s, pool_stride_h, pool_stride_c, valid_stride_s,
                          pos_stride_g, pos_stride_t,
                          path_stride_g, path_stride_t, path_stride_h, path_stride_d,
                          out_stride_g, out_stride_t, out_stride_h, HEAD_SIZE,
                          GROUP: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m // GROUP
    head = kv_head * GROUP + m % GROUP
    position = tl.load(positions_ptr + g * pos_stride_g + t * pos_stride_t,
                       mask=t < num_rows, other=-1)
    row_live = position >= 0
    d = tl.arange(0, HEAD_PAD)
    d_live = d < HEAD_SIZE
    tile = row_live[:, None] & d_live[None, :]
    q = tl.load(q_ptr + g * q_stride_g + t[:, None] * q_stride_t + head[:, None] * q_stride_h
                + d[None, :], mask=tile, other=0.0)
    if UPCAST:  # the Triton interpreter's bf16 dot is wrong: compute in float32
        q = q.to(tl.float32)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    pool = slot * pool_stride_s + kv_head * pool_stride_h
    run_max = tl.full([BLOCK_M], NEG_START, tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # the tile's rows see no key past their last position: stop there
    key_end = tl.minimum(num_keys, tl.max(position, axis=0) + 1)
    for start in range(0, key_end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_live = (j < key_end) & (tl.load(valid_ptr + slot * valid_stride_s + j,
                                            mask=j < key_end, other=0) != 0)
        kv_tile = key_live[:, None] & d_live[None, :]
        k = tl.load(keys_ptr + pool + j[:, None] * pool_stride_c + d[None, :], mask=kv_tile,
                    other=0.0)
        v = tl.load(values_ptr + pool + j[:, None] * pool_stride_c + d[None, :], mask=kv_tile,
                    other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (row_live[:, None] & key_live[None, :]
                   & (j[None, :] <= position[:, None]))
        run_max, run_sum, acc, p = _rescale(run_max, run_sum, acc, scores, visible)
        acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    path = g * path_stride_g + t * path_stride_t + kv_head * path_stride_h
    for i in range(0, num_path):  # a draft node's own path: every row sees all of its keys
        offsets = (path + i * path_stride_d)[:, None] + d[None, :]
        k = tl.load(path_k_ptr + offsets, mask=tile, other=0.0).to(tl.float32)
        v = tl.load(path_v_ptr + offsets, mask=tile, other=0.0).to(tl.float32)
        scores = tl.sum(q.to(tl.float32) * k, axis=1) * scale
        run_max, run_sum, acc, p = _rescale(run_max, run_sum, acc, scores[:, None],
                                            row_live[:, None])
        acc += p * v
    out = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
    tl.store(out_ptr + g * out_stride_g + t[:, None] * out_stride_t
             + head[:, None] * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(t < num_rows)[:, None] & d_live[None, :])
