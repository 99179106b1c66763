"""Triton kernel: a drafting step's top-k with its log-probabilities.

Wrapper and reference: `vllm_specplug/proposers/draft_topk.py`. One program
per logits row reads the row once, in chunks of BLOCK_V: an online
log-sum-exp of logits / temperature (the softmax's normaliser) and a running
top-k (each chunk's best entries by repeated argmax, each replacing the
running list's smallest when larger; only as many passes as the chunk has
entries above the list's smallest, at most k). It writes the k best in descending order,
as log-probabilities (value - log-sum-exp) with their ids. What it replaces
is a float copy, a division, a log-softmax and a sort-based top-k, several
launches each (the drafting pass is launch-bound on the GPU).
"""
import triton
import triton.language as tl

NEG_START = tl.constexpr(-1.0e30)  # finite: the first chunk's rescale stays NaN-free


@triton.jit
def draft_topk_kernel(logits_ptr, logprobs_ptr, ids_ptr, row_stride, vocab_size, temperature,
                      K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    slot = tl.arange(0, K_PAD)
    lane = tl.arange(0, BLOCK_V)
    # padding slots hold +inf: never the running minimum, never replaced
    top_vals = tl.where(slot < K, float("-inf"), float("inf"))
    top_ids = tl.zeros([K_PAD], dtype=tl.int64)
    run_max = tl.full([], NEG_START, tl.float32)
    run_sum = tl.zeros([], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + lane
        x = tl.load(base + offs, mask=offs < vocab_size, other=float("-inf"))
        x = x.to(tl.float32) / temperature
        new_max = tl.maximum(run_max, tl.max(x, 0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        run_max = new_max
        if K > 1:
            # only entries above the running k-th best can enter the list: after
            # the first chunks a handful, not K, so most chunks cost few passes
            kth = tl.min(top_vals, 0)
            num_better = tl.minimum(tl.sum((x > kth).to(tl.int32), 0), K)
        else:  # a chain's one pass needs no count
            num_better = 1
        for _ in range(num_better):
            best = tl.max(x, 0)
            at = tl.argmax(x, 0)
            # the running minimum's slot, if the chunk's best beats it
            replace = (slot == tl.argmin(top_vals, 0)) & (top_vals < best)
            top_vals = tl.where(replace, best, top_vals)
            top_ids = tl.where(replace, start + at, top_ids)
            x = tl.where(lane == at, float("-inf"), x)
    lse = run_max + tl.log(run_sum)
    top_vals = tl.where(slot < K, top_vals, float("-inf"))  # padding out of the ranking
    for i in tl.static_range(K):
        best = tl.max(top_vals, 0)
        at = tl.argmax(top_vals, 0)
        tl.store(logprobs_ptr + row * K + i, best - lse)
        tl.store(ids_ptr + row * K + i, tl.sum(tl.where(slot == at, top_ids, 0), 0))
        top_vals = tl.where(slot == at, float("-inf"), top_vals)
