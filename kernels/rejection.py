"""Triton kernels: stochastic (rejection-sampling) verification of trees and
chains. Wrappers and references: `vllm_specplug/verification/tree_sampling.py`.

Grid (B, NUM_SPLITS): every program of a request repeats the cheap acceptance
walk (a few scalar loads), then takes the argmax of residual / exp_samples over
its slice of the vocabulary; `residual_argmax_reduce_kernel` combines slices.
Division is IEEE round-to-nearest (`div_rn`) so ties break as in PyTorch.
"""
import triton
import triton.language as tl

from vllm_specplug.kernels.tree_verify import BIG, _pick


@triton.jit
def _slice_argmax(p_row_ptr, q_row_ptr, exp_row_ptr, child_token, child_rank,
                  num_children, use_draft, split, V, NUM_SPLITS: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """(max, first index) of r / exp over this split's slice, where r is p with
    the rejected children's tokens zeroed, or max(p - q, 0) when `use_draft`.

    Children are excluded one at a time (a handful of vector compares per
    block): a [BLOCK_V, N] membership tile spilled registers and ran 10x slower.
    """
    per_split = tl.cdiv(tl.cdiv(V, NUM_SPLITS), BLOCK_V) * BLOCK_V
    v_lo = split * per_split
    v_hi = tl.minimum(V, v_lo + per_split)
    best_val = tl.full([], -1.0, tl.float32)
    best_idx = tl.full([], BIG, tl.int32)
    # A scalar bound, not `in_range & use_draft`: vector & scalar-bool masks
    # are rejected by the Triton interpreter.
    q_hi = tl.where(use_draft, v_hi, 0)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        in_range = offs < v_hi
        p = tl.load(p_row_ptr + offs, mask=in_range, other=0.0)
        q = tl.load(q_row_ptr + offs, mask=offs < q_hi, other=0.0)
        e = tl.load(exp_row_ptr + offs, mask=in_range, other=1.0)
        r = tl.where(use_draft, tl.maximum(p - q, 0.0), p)
        for k in range(num_children):
            token = tl.sum(tl.where(child_rank == k, child_token, 0), axis=0)
            r = tl.where(offs == token, 0.0, r)
        score = tl.where(in_range, tl.math.div_rn(r, e), -1.0)
        block_max = tl.max(score, axis=0)
        block_idx = tl.min(tl.where(score == block_max, offs, BIG), axis=0)
        better = block_max > best_val
        best_idx = tl.where(better, block_idx, best_idx)
        best_val = tl.where(better, block_max, best_val)
    return best_val, best_idx


@triton.jit
def verify_tree_stochastic_kernel(
        token_ptr, parent_ptr, target_probs_ptr, uniform_ptr, exp_ptr,
        out_token_ptr, num_accepted_ptr, accepted_node_ptr, part_val_ptr,
        part_idx_ptr, N, V, N_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    first = split == 0
    n = tl.arange(0, N_PAD)
    valid = n < N
    token = tl.load(token_ptr + b * N + n, mask=valid, other=-1)
    parent = tl.load(parent_ptr + b * N + n, mask=valid, other=-2)
    uniform = tl.load(uniform_ptr + b * N + n, mask=valid, other=2.0)
    probs = target_probs_ptr + b * N * V
    cur = tl.full([], 0, tl.int32)
    num = tl.full([], 0, tl.int32)
    mass = tl.full([], 1.0, tl.float32)
    cand = (parent == cur) & valid
    p_child = tl.load(probs + token, mask=cand, other=0.0)
    c = tl.min(tl.where(cand, n, BIG), axis=0)
    while c < BIG:
        p_c = _pick(p_child, n, c)
        if _pick(uniform, n, c) * mass < p_c:
            tl.store(out_token_ptr + b * N + num, _pick(token, n, c), mask=first)
            num += 1
            tl.store(accepted_node_ptr + b * N + num, c.to(tl.int64), mask=first)
            cur = c
            mass = tl.full([], 1.0, tl.float32)
            cand = (parent == cur) & valid
            p_child = tl.load(probs + cur.to(tl.int64) * V + token, mask=cand, other=0.0)
        else:
            mass = mass - p_c
            cand = cand & (n != c)
        c = tl.min(tl.where(cand, n, BIG), axis=0)
    is_child = (parent == cur) & valid
    child_rank = tl.where(is_child, tl.cumsum(is_child.to(tl.int32), axis=0) - 1, -1)
    best_val, best_idx = _slice_argmax(
        probs + cur.to(tl.int64) * V, probs, exp_ptr + b * V, token, child_rank,
        tl.sum(is_child.to(tl.int32), axis=0), tl.full([], 0, tl.int1),
        split, V, NUM_SPLITS, BLOCK_V)
    tl.store(part_val_ptr + b * NUM_SPLITS + split, best_val)
    tl.store(part_idx_ptr + b * NUM_SPLITS + split, best_idx)
    tl.store(num_accepted_ptr + b, num.to(tl.int64), mask=first)
    tl.store(accepted_node_ptr + b * N, tl.full([], 0, tl.int64), mask=first)


@triton.jit
def rejection_sample_chain_kernel(
        draft_token_ptr, num_draft_ptr, draft_probs_ptr, target_probs_ptr,
        uniform_ptr, exp_ptr, out_token_ptr, num_accepted_ptr, accepted_node_ptr,
        part_val_ptr, part_idx_ptr, K, V, NUM_SPLITS: tl.constexpr,
        BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    first = split == 0
    num_drafts = tl.load(num_draft_ptr + b).to(tl.int32)
    num = tl.full([], 0, tl.int32)
    rejected = tl.full([], 0, tl.int32)
    while (num < num_drafts) & (rejected == 0):
        token = tl.load(draft_token_ptr + b * K + num)
        p = tl.load(target_probs_ptr + (b * (K + 1) + num) * V + token)
        q = tl.load(draft_probs_ptr + (b * K + num) * V + token)
        if tl.load(uniform_ptr + b * K + num) * q < p:
            tl.store(out_token_ptr + b * (K + 1) + num, token, mask=first)
            num += 1
            tl.store(accepted_node_ptr + b * (K + 1) + num, num.to(tl.int64), mask=first)
        else:
            rejected = tl.full([], 1, tl.int32)
    q_pos = tl.minimum(num, K - 1)
    best_val, best_idx = _slice_argmax(
        target_probs_ptr + (b * (K + 1) + num) * V,
        draft_probs_ptr + (b * K + q_pos) * V, exp_ptr + b * V,
        tl.full([2], -1, tl.int64), tl.full([2], -1, tl.int32), 0, num < num_drafts,
        split, V, NUM_SPLITS, BLOCK_V)
    tl.store(part_val_ptr + b * NUM_SPLITS + split, best_val)
    tl.store(part_idx_ptr + b * NUM_SPLITS + split, best_idx)
    tl.store(num_accepted_ptr + b, num.to(tl.int64), mask=first)
    tl.store(accepted_node_ptr + b * (K + 1), tl.full([], 0, tl.int64), mask=first)


@triton.jit
def residual_argmax_reduce_kernel(part_val_ptr, part_idx_ptr, num_accepted_ptr,
                                  out_token_ptr, ROW_LEN, NUM_SPLITS: tl.constexpr,
                                  SPLITS_PAD: tl.constexpr):
    """out[b, num_accepted[b]] = first index of the best slice maximum."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    val = tl.load(part_val_ptr + b * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=-2.0)
    idx = tl.load(part_idx_ptr + b * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=BIG)
    best = tl.max(val, axis=0)
    token = tl.min(tl.where(val == best, idx, BIG), axis=0)
    num = tl.load(num_accepted_ptr + b)
    tl.store(out_token_ptr + b * ROW_LEN + num, token.to(tl.int64))
