"""Triton kernels: greedy and stochastic tree verification.

Wrappers and references: `vllm_specplug/verification/tree_greedy.py` and
`tree_sampling.py`. One program per request walks the tree; the stochastic
kernel also splits the vocabulary over NUM_SPLITS programs for the residual
sample (each repeats the cheap walk, so no inter-program sync is needed).
"""
import triton
import triton.language as tl

NO_NODE = tl.constexpr(-1)
BIG = tl.constexpr(1 << 30)


@triton.jit
def _pick(values, n, index):
    """values[index] of a register vector, as a scalar."""
    return tl.sum(tl.where(n == index, values, 0), axis=0)


@triton.jit
def verify_tree_greedy_kernel(token_ptr, parent_ptr, target_argmax_ptr,
                              out_token_ptr, num_accepted_ptr, accepted_node_ptr,
                              N, N_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, N_PAD)
    valid = n < N
    token = tl.load(token_ptr + b * N + n, mask=valid, other=-1)
    parent = tl.load(parent_ptr + b * N + n, mask=valid, other=-2)
    argmax = tl.load(target_argmax_ptr + b * N + n, mask=valid, other=-1)
    cur = tl.full([], 0, tl.int32)
    num = tl.full([], 0, tl.int32)
    want = _pick(argmax, n, cur)
    nxt = tl.min(tl.where((parent == cur) & (token == want), n, BIG), axis=0)
    while nxt < BIG:
        num += 1
        tl.store(out_token_ptr + b * N + num - 1, want)
        tl.store(accepted_node_ptr + b * N + num, nxt.to(tl.int64))
        cur = nxt
        want = _pick(argmax, n, cur)
        nxt = tl.min(tl.where((parent == cur) & (token == want), n, BIG), axis=0)
    tl.store(out_token_ptr + b * N + num, want)
    tl.store(accepted_node_ptr + b * N, tl.full([], 0, tl.int64))
    tl.store(num_accepted_ptr + b, num.to(tl.int64))


# `N` moves with the draft length, so it is not specialized on:
# Triton compiles a variant per value class (1, a multiple of 16, other)
# on first use, which a served engine met in its first requests
# (docs/results/batch_draft_length_h200_run12)
@triton.jit(do_not_specialize=["N"])
def verify_tree_greedy_rows_kernel(target_argmax_ptr, input_ids_ptr, logits_indices_ptr,
                                   cu_num_logits_ptr, parent_ptr, idx_mapping_ptr,
                                   slot_num_nodes_ptr, out_token_ptr, num_accepted_ptr,
                                   accepted_node_ptr, N, N_PAD: tl.constexpr):
    """Greedy verification read straight from the runner's flat logits rows:
    request b's node n is row cu_num_logits[b] + n (nodes past its row count
    are cut, and so are nodes past its slot's drafted count
    slot_num_nodes[idx_mapping[b]]), its token the input id at that row's
    logits index and its parent the state slot's (idx_mapping[b]). Each
    output row is written once, padded with -1."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, N_PAD)
    first = tl.load(cu_num_logits_ptr + b).to(tl.int64)
    count = tl.load(cu_num_logits_ptr + b + 1).to(tl.int64) - first
    slot = tl.load(idx_mapping_ptr + b).to(tl.int64)
    # rows past the drafted tree hold stale or padding drafts
    count = tl.minimum(count, tl.load(slot_num_nodes_ptr + slot).to(tl.int64))
    live = n < count
    row = first + tl.minimum(n, count - 1)
    token = tl.load(input_ids_ptr + tl.load(logits_indices_ptr + row, mask=live, other=0),
                    mask=live, other=-1).to(tl.int64)
    parent = tl.load(parent_ptr + slot * N + n, mask=live, other=-2)
    argmax = tl.load(target_argmax_ptr + row, mask=live, other=-1)
    path = tl.where(n == 0, 0, NO_NODE).to(tl.int64)
    emitted = tl.full([N_PAD], NO_NODE, tl.int64)
    cur = tl.full([], 0, tl.int64)
    num = tl.full([], 0, tl.int32)
    want = _pick(argmax, n, cur)
    nxt = tl.min(tl.where((parent == cur) & (token == want), n, BIG), axis=0)
    while nxt < BIG:
        emitted = tl.where(n == num, want, emitted)
        num += 1
        path = tl.where(n == num, nxt, path)
        cur = nxt.to(tl.int64)
        want = _pick(argmax, n, cur)
        nxt = tl.min(tl.where((parent == cur) & (token == want), n, BIG), axis=0)
    emitted = tl.where(n == num, want, emitted)
    valid = n < N
    tl.store(out_token_ptr + b * N + n, emitted, mask=valid)
    tl.store(accepted_node_ptr + b * N + n, path, mask=valid)
    tl.store(num_accepted_ptr + b, num.to(tl.int64))
