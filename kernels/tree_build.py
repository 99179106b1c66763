"""Triton kernel: EAGLE-2 tree construction, one program per request.

Python wrapper and reference: `vllm_specplug/verification/tree_build.py`.
"""
import triton
import triton.language as tl

NO_NODE = tl.constexpr(-1)
ROOT_PARENT = tl.constexpr(-1)
BIG = tl.constexpr(1 << 30)


@triton.jit
def _select_candidates(cand_score_ptr, node_of_cand_ptr, C, NUM_SELECTED,
                       C_PAD: tl.constexpr, BLOCK_J: tl.constexpr):
    """Rank every candidate by (score desc, index asc); the top NUM_SELECTED
    become nodes 1.. in index order. Returns (candidate ids, node ids)."""
    ci = tl.arange(0, C_PAD)
    valid_i = ci < C
    score_i = tl.load(cand_score_ptr + ci, mask=valid_i, other=float("-inf"))
    rank = tl.zeros([C_PAD], dtype=tl.int32)
    for j0 in range(0, C, BLOCK_J):
        cj = j0 + tl.arange(0, BLOCK_J)
        valid_j = cj < C
        score_j = tl.load(cand_score_ptr + cj, mask=valid_j, other=float("-inf"))
        ahead = (score_j[None, :] > score_i[:, None]) | (
            (score_j[None, :] == score_i[:, None]) & (cj[None, :] < ci[:, None]))
        rank += tl.sum((ahead & valid_j[None, :]).to(tl.int32), axis=1)
    selected = (rank < NUM_SELECTED) & valid_i
    node = tl.cumsum(selected.to(tl.int32), axis=0)
    node = tl.where(selected, node, NO_NODE)
    tl.store(node_of_cand_ptr + ci, node.to(tl.int64), mask=valid_i)
    return ci, node, selected


@triton.jit
def _links_and_ancestry(parent_out_ptr, mask_out_ptr, packed_out_ptr,
                        first_child_ptr, next_sibling_ptr, depth_ptr, pos_ptr,
                        seq_len, N, N_PAD: tl.constexpr, NUM_WORDS: tl.constexpr):
    n = tl.arange(0, N_PAD)
    valid = n < N
    parent = tl.load(parent_out_ptr + n, mask=valid, other=NO_NODE)
    is_child = (parent[None, :] == n[:, None]) & valid[None, :]
    first = tl.min(tl.where(is_child, n[None, :], BIG), axis=1)
    tl.store(first_child_ptr + n, tl.where(first == BIG, NO_NODE, first).to(tl.int64),
             mask=valid)
    later_sibling = ((parent[None, :] == parent[:, None]) & (n[None, :] > n[:, None])
                     & valid[None, :] & (n[:, None] > 0))
    nxt = tl.min(tl.where(later_sibling, n[None, :], BIG), axis=1)
    tl.store(next_sibling_ptr + n, tl.where(nxt == BIG, NO_NODE, nxt).to(tl.int64),
             mask=valid)
    # Walk every node's ancestor chain at once, one level per iteration.
    visible = n[:, None] == n[None, :]
    depth = tl.zeros([N_PAD], dtype=tl.int32)
    ancestor = parent
    while tl.max(ancestor, axis=0) >= 0:
        active = ancestor >= 0
        depth += active.to(tl.int32)
        visible = visible | ((n[None, :] == ancestor[:, None]) & active[:, None])
        ancestor = tl.load(parent_out_ptr + tl.maximum(ancestor, 0),
                           mask=active & valid, other=NO_NODE)
    tl.store(depth_ptr + n, depth.to(tl.int64), mask=valid)
    tl.store(pos_ptr + n, (seq_len + depth).to(tl.int64), mask=valid)
    both = valid[:, None] & valid[None, :]
    tl.store(mask_out_ptr + n[:, None] * N + n[None, :], visible.to(tl.int8), mask=both)
    bit = tl.full([N_PAD], 1, tl.int64) << (n % 32).to(tl.int64)
    for w in tl.static_range(NUM_WORDS):
        in_word = visible & (n[None, :] // 32 == w) & both
        word = tl.sum(tl.where(in_word, bit[None, :], 0), axis=1)
        tl.store(packed_out_ptr + n * NUM_WORDS + w, word.to(tl.int32), mask=valid)


@triton.jit
def build_draft_tree_kernel(
        cand_token_ptr, cand_score_ptr, cand_parent_ptr, root_token_ptr,
        seq_len_ptr, node_of_cand_ptr, token_out_ptr, parent_out_ptr,
        cand_out_ptr, depth_ptr, pos_ptr, mask_out_ptr, packed_out_ptr,
        first_child_ptr, next_sibling_ptr, C, N,
        C_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCK_J: tl.constexpr,
        NUM_WORDS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cand_base = b * C
    node_base = b * N
    ci, node, selected = _select_candidates(
        cand_score_ptr + cand_base, node_of_cand_ptr + cand_base, C, N - 1,
        C_PAD, BLOCK_J)
    token = tl.load(cand_token_ptr + cand_base + ci, mask=selected)
    parent_cand = tl.load(cand_parent_ptr + cand_base + ci, mask=selected,
                          other=ROOT_PARENT)
    tl.store(token_out_ptr + node_base + node, token, mask=selected)
    tl.store(cand_out_ptr + node_base + node, ci.to(tl.int64), mask=selected)
    tl.store(token_out_ptr + node_base, tl.load(root_token_ptr + b))
    tl.store(cand_out_ptr + node_base, tl.full([], NO_NODE, tl.int64))
    tl.store(parent_out_ptr + node_base, tl.full([], NO_NODE, tl.int64))
    tl.debug_barrier()  # node_of_cand is read back by other threads
    has_parent = selected & (parent_cand != ROOT_PARENT)
    parent_node = tl.load(node_of_cand_ptr + cand_base + tl.maximum(parent_cand, 0),
                          mask=has_parent, other=0)
    tl.store(parent_out_ptr + node_base + node, parent_node, mask=selected)
    tl.debug_barrier()  # parents are read back by other threads
    _links_and_ancestry(parent_out_ptr + node_base, mask_out_ptr + b * N * N,
                        packed_out_ptr + node_base * NUM_WORDS,
                        first_child_ptr + node_base, next_sibling_ptr + node_base,
                        depth_ptr + node_base, pos_ptr + node_base,
                        tl.load(seq_len_ptr + b), N, N_PAD, NUM_WORDS)
