"""Triton kernel: attention of draft-tree nodes over a paged KV cache.

Wrapper and reference: `vllm_specplug/verification/tree_attention.py`.
Grid (request rows, KV heads, row tiles). A program holds BLOCK_M query rows
of one request and one KV head: row m is node m // GROUP, query head
kv_head * GROUP + m % GROUP (GQA: the group shares every K/V tile it loads,
so a request's cache is read once per KV head). Keys at positions below
`seq_len` (the prefix) are visible to every node; the key at `seq_len + j`
(tree node j, written there by the backend's sequential slot mapping) is
visible to node i when bit j of i's ancestor mask is set. Online softmax in
float32 (FlashAttention, arXiv 2205.14135). Rows of requests whose
`num_nodes` is 0 are neither read nor written, so the grid can cover a
padded batch (a captured CUDA graph) at no cost beyond the launch.
"""
import triton
import triton.language as tl

WORD_BITS = tl.constexpr(32)
NEG_START = tl.constexpr(-1.0e30)  # finite, so a row with no visible key stays NaN-free


@triton.jit
def _visible(bits_ptr, node, pos, seq_len, kv_len, row_live, NUM_NODES, NUM_WORDS):
    """[BLOCK_M, BLOCK_N] bool: key position `pos` is visible to `node`."""
    tree_j = pos - seq_len
    in_tree = (tree_j >= 0) & (pos < kv_len)
    word_ptr = bits_ptr + (node[:, None] * NUM_WORDS + tree_j[None, :] // WORD_BITS)
    words = tl.load(word_ptr, mask=row_live[:, None] & in_tree[None, :], other=0)
    ancestor = ((words >> (tree_j[None, :] % WORD_BITS)) & 1) != 0
    return ((pos < seq_len)[None, :] | ancestor) & row_live[:, None]


@triton.jit
def load_paged_kv(k_cache_ptr, v_cache_ptr, table, pos, live, kv_head, d, d_live,
                  k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
                  BLOCK_SIZE: tl.constexpr):
    """K and V [BLOCK_N, HEAD_PAD] of one KV head at positions `pos` of a
    request's paged cache (`table`: its block-table row); zeros where not
    `live`."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    offset = (pos % BLOCK_SIZE).to(tl.int64)
    tile = live[:, None] & d_live[None, :]
    k = tl.load(k_cache_ptr + (block * k_stride_b + offset * k_stride_s
                               + kv_head * k_stride_h)[:, None] + d[None, :],
                mask=tile, other=0.0)
    v = tl.load(v_cache_ptr + (block * v_stride_b + offset * v_stride_s
                               + kv_head * v_stride_h)[:, None] + d[None, :],
                mask=tile, other=0.0)
    return k, v


@triton.jit
def tree_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr,
                          first_token_ptr, seq_len_ptr, num_nodes_ptr, bits_ptr, scale,
                          q_stride_t, q_stride_h, out_stride_t, out_stride_h,
                          k_stride_b, k_stride_s, k_stride_h,
                          v_stride_b, v_stride_s, v_stride_h, block_table_stride,
                          NUM_NODES, NUM_WORDS, HEAD_SIZE,
                          GROUP: tl.constexpr, HEAD_PAD: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr, partial_out_ptr, partial_lse_ptr, NUM_HEADS,
                          NUM_SPLITS: tl.constexpr):
    """NUM_SPLITS > 1 (flash-decoding, split-K): program_id(2) is row tile x
    split; each split attends to its share of the keys and writes its
    normalised output and log-sum-exp per (row, head, split) for
    `tree_attention_merge_kernel`. At batch 1 a 16-node tree with GQA 4 is
    one row tile per KV head: 8 programs for the whole prefix otherwise."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    num_nodes = tl.load(num_nodes_ptr + b)
    seq_len = tl.load(seq_len_ptr + b)
    first = tl.load(first_token_ptr + b).to(tl.int64)
    kv_len = tl.where(num_nodes > 0, seq_len + num_nodes, 0)
    split = tl.program_id(2) % NUM_SPLITS
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_start = split * chunk
    kv_end = tl.minimum(kv_start + chunk, kv_len)
    m = (tl.program_id(2) // NUM_SPLITS) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_live = m < num_nodes * GROUP
    node = m // GROUP
    head = kv_head * GROUP + m % GROUP
    d = tl.arange(0, HEAD_PAD)
    d_live = d < HEAD_SIZE
    q_rows = q_ptr + (first + node)[:, None] * q_stride_t + head[:, None] * q_stride_h
    q = tl.load(q_rows + d[None, :], mask=row_live[:, None] & d_live[None, :], other=0.0)
    if UPCAST:  # the Triton interpreter's bf16 dot is wrong: compute in float32
        q = q.to(tl.float32)
    bits = bits_ptr + b * NUM_NODES * NUM_WORDS
    table = block_table_ptr + b * block_table_stride
    m_i = tl.full([BLOCK_M], NEG_START, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        k, v = load_paged_kv(k_cache_ptr, v_cache_ptr, table, pos, pos < kv_end, kv_head, d,
                             d_live, k_stride_b, k_stride_s, k_stride_h, v_stride_b,
                             v_stride_s, v_stride_h, BLOCK_SIZE)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = _visible(bits, node, pos, seq_len, kv_len, row_live, NUM_NODES, NUM_WORDS)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # dead rows: 0, never stored
    live = row_live[:, None] & d_live[None, :]
    if NUM_SPLITS == 1:
        out_rows = out_ptr + (first + node)[:, None] * out_stride_t + head[:, None] * out_stride_h
        tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live)
    else:
        slot = ((first + node) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + slot[:, None] * HEAD_PAD + d[None, :], out, mask=live)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + slot, lse, mask=row_live)


@triton.jit
def tree_attention_merge_kernel(out_ptr, partial_out_ptr, partial_lse_ptr, first_token_ptr,
                                num_nodes_ptr, out_stride_t, out_stride_h, HEAD_SIZE, NUM_HEADS,
                                GROUP: tl.constexpr, HEAD_PAD: tl.constexpr,
                                BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The splits of each tree row merged by their log-sum-exp (grid as the
    attention kernel's, without the split axis)."""
    b = tl.program_id(0).to(tl.int64)
    num_nodes = tl.load(num_nodes_ptr + b)
    first = tl.load(first_token_ptr + b).to(tl.int64)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_live = m < num_nodes * GROUP
    node = m // GROUP
    head = tl.program_id(1) * GROUP + m % GROUP
    d = tl.arange(0, HEAD_PAD)
    live = row_live[:, None] & (d < HEAD_SIZE)[None, :]
    slot = ((first + node) * NUM_HEADS + head) * NUM_SPLITS
    top = tl.full([BLOCK_M], NEG_START, tl.float32)
    for s in range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(partial_lse_ptr + slot + s, mask=row_live,
                                      other=float("-inf")))
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for s in range(NUM_SPLITS):
        weight = tl.exp(tl.load(partial_lse_ptr + slot + s, mask=row_live,
                                other=float("-inf")) - top)
        part = tl.load(partial_out_ptr + (slot + s)[:, None] * HEAD_PAD + d[None, :],
                       mask=live, other=0.0)
        acc += weight[:, None] * part
        total += weight
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_rows = out_ptr + (first + node)[:, None] * out_stride_t + head[:, None] * out_stride_h
    tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live)
