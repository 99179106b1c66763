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
