"""Triton kernels: prompt-lookup (n-gram) drafting on the device, over Model
Runner V2's token buffer, with no host synchronisation.

The selection is `specplug_ngram`'s (reference: `longest_matches` in
`vllm_specplug/proposers/ngram.py`): the longest n in [N_MIN, N_MAX] whose
last-n-token suffix also ends at an earlier position e <= L - 2; among the
ends of that n, the most recent one followed by K tokens, else the earliest.
vLLM's GPU n-gram instead takes the rightmost end, which in repetitive text
is often just before the end of the sequence and leaves a short draft.

Two passes, as a max-reduction: the scan scores every candidate end in a
block of positions and keeps the block's best score; the finalize pass takes
the best block and gathers the draft. A score packs (n, preference) so that
one max picks the longest n first, then the preferred end:
    score = n * (2L + 2) + pref, pref = L + 1 + e for an end with K tokens
    after it (the most recent wins), else L - e (the earliest wins);
    score 0 = no match. Python wrapper: `vllm_specplug/proposers/ngram_device.py`.
"""
import triton
import triton.language as tl


@triton.jit
def ngram_scan_kernel(
    token_ids_ptr,     # [max_num_reqs, stride] int32: every request's history
    token_ids_stride,
    idx_mapping_ptr,   # [num_reqs] int: batch row -> state slot
    num_tokens_ptr,    # [max_num_reqs] int32: history length L per slot
    num_sampled_ptr,   # [num_reqs] int32: tokens sampled this step (0: prefill chunk)
    block_score_ptr,   # [num_reqs, NUM_BLOCKS] int64 (out)
    NUM_BLOCKS,
    K: tl.constexpr, N_MIN: tl.constexpr, N_MAX: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    length = tl.load(num_tokens_ptr + slot).to(tl.int64)
    eligible = (tl.load(num_sampled_ptr + row) > 0) & (length >= N_MIN + 1)
    out = block_score_ptr + row * NUM_BLOCKS + block
    if not (eligible & (block * BLOCK <= length - 2)):
        tl.store(out, tl.zeros((), tl.int64))
        return
    history = token_ids_ptr + slot * token_ids_stride
    ends = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    running = ends <= length - 2           # an end with at least one token after it
    matched = tl.zeros([BLOCK], tl.int64)
    for j in tl.static_range(N_MAX):       # grow the match backwards, one token a step
        running = running & (ends - j >= 0)
        token = tl.load(history + ends - j, mask=running, other=-1)
        suffix_token = tl.load(history + length - 1 - j, mask=length - 1 - j >= 0, other=-2)
        running = running & (token == suffix_token)
        matched += running.to(tl.int64)
    full = ends <= length - 1 - K
    pref = tl.where(full, length + 1 + ends, length - ends)
    score = tl.where(matched >= N_MIN, matched * (2 * length + 2) + pref, 0)
    tl.store(out, tl.max(score, axis=0))


@triton.jit
def ngram_finalize_kernel(
    token_ids_ptr, token_ids_stride, idx_mapping_ptr, num_tokens_ptr, num_sampled_ptr,
    block_score_ptr,   # [num_reqs, NUM_BLOCKS] int64
    draft_ids_ptr,     # [num_reqs, K] int64 (out): the draft, padded with the last token
    num_draft_ptr,     # [num_reqs] int32 (out): draft length before padding
    counts_ptr,        # [2] int64 (in/out, if COUNT): += draft tokens, draft slots
    NUM_BLOCKS,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCKS_PAD: tl.constexpr, COUNT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, BLOCKS_PAD)
    scores = tl.load(block_score_ptr + row * NUM_BLOCKS + blocks, mask=blocks < NUM_BLOCKS,
                     other=0)
    best = tl.max(scores, axis=0)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    length = tl.load(num_tokens_ptr + slot).to(tl.int64)
    history = token_ids_ptr + slot * token_ids_stride
    n = best // (2 * length + 2)
    pref = best - n * (2 * length + 2)
    end = tl.where(pref > length, pref - length - 1, length - pref)
    num_draft = tl.where(best > 0, tl.minimum(length - 1 - end, K), 0)
    k = tl.arange(0, K_PAD)
    in_draft = k < num_draft
    last = tl.load(history + tl.maximum(length - 1, 0))
    token = tl.load(history + end + 1 + k, mask=in_draft, other=0)
    # Padded slots hold the last token: ordinary drafts that verification
    # accepts or rejects like any other, so padding never changes the output.
    tl.store(draft_ids_ptr + row * K + k, tl.where(in_draft, token, last).to(tl.int64),
             mask=k < K)
    tl.store(num_draft_ptr + row, num_draft.to(tl.int32))
    if COUNT:  # statistics without extra launches: one atomic pair per row
        tl.atomic_add(counts_ptr, num_draft.to(tl.int64))
        drafting = (tl.load(num_sampled_ptr + row) > 0).to(tl.int64)
        tl.atomic_add(counts_ptr + 1, drafting * K)
