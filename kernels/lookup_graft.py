"""Triton kernel: prompt lookups grafted onto Model Runner V2's stored draft
trees, one program per request, no host synchronisation.

The reference is `graft_lookups` in `vllm_specplug/proposers/lookup.py`
(plain PyTorch, the engine's path off CUDA); the launch glue is
`DeviceLookup.graft` there. A row whose lookup found tokens (1 to L:
`ngram_finalize_kernel`'s `num_draft`; a row that sampled nothing has 0)
follows the longest prefix of the lookup through its tree's nodes that the
graft keeps (a match at depth d keeps the nodes before n - span + d + 1,
span = min(n - 1, tokens found)) and writes the remaining g tokens as a
chain under the node it ends at, into the tree's last g nodes: their draft
tokens, parents, depths, packed ancestor masks and (if kept) ranks. Each grafted node's depth
and mask come from its anchor's and the nodes grafted before it, held in
registers: the program never reads what it wrote.
"""
import triton
import triton.language as tl


@triton.jit
def lookup_graft_kernel(
    drafts_ptr,        # [num_reqs, drafts_stride] int64 (in/out): node i's token at i - 1
    drafts_stride,
    lookups_ptr,       # [num_reqs, L] int64: each row's lookup
    num_lookup_ptr,    # [num_reqs] int32: its tokens found (0: none, at most L)
    idx_mapping_ptr,   # [num_reqs] int: batch row -> state slot
    parents_ptr,       # [S, N] int64 (in/out): each slot's tree
    depths_ptr,        # [S, N] int32 (in/out)
    bits_ptr,          # [S, N, W] int32 (in/out): packed ancestor masks
    ranks_ptr,         # [S, N] int64 (in/out, if HAS_RANKS)
    counts_ptr,        # [2] int64 (in/out): += rows with a lookup, nodes grafted
    num_nodes,         # n: this step's tree size, root included (<= N)
    N: tl.constexpr, W: tl.constexpr, L: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HAS_RANKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    num_found = tl.load(num_lookup_ptr + row).to(tl.int64)
    found = num_found > 0
    span = tl.minimum(num_nodes - 1, num_found)
    node = tl.arange(0, BLOCK_N)
    real = (node >= 1) & (node < num_nodes)
    parents = tl.load(parents_ptr + slot * N + node, mask=real, other=-2)
    tokens = tl.load(drafts_ptr + row * drafts_stride + node - 1, mask=real, other=-1)
    anchor = tl.zeros((), tl.int64)
    matched = tl.zeros((), tl.int64)
    going = found
    for depth in tl.static_range(L):
        going = going & (depth < span)
        want = tl.load(lookups_ptr + row * L + depth)
        kept = real & (node < num_nodes - span + depth + 1)
        hit = kept & (parents == anchor) & (tokens == want)
        first_hit = tl.min(tl.where(hit, node, BLOCK_N), axis=0)
        going = going & (first_hit < BLOCK_N)
        anchor = tl.where(going, first_hit, anchor)
        matched += going.to(tl.int64)
    num_graft = tl.where(found, span - matched, 0)
    first = num_nodes - num_graft
    word = tl.arange(0, BLOCK_W)
    mask_bits = tl.load(bits_ptr + (slot * N + anchor) * W + word, mask=word < W, other=0)
    depth_of = tl.load(depths_ptr + slot * N + anchor)
    for j in tl.static_range(L):
        grafting = j < num_graft
        at = first + j
        parent = anchor if j == 0 else at - 1
        token = tl.load(lookups_ptr + row * L + matched + j, mask=grafting, other=0)
        own = tl.where(word == at // 32, tl.full((), 1, tl.int32) << (at % 32).to(tl.int32), 0)
        mask_bits = mask_bits | own
        depth_of += 1
        tl.store(drafts_ptr + row * drafts_stride + at - 1, token, mask=grafting)
        tl.store(parents_ptr + slot * N + at, parent.to(tl.int64), mask=grafting)
        tl.store(depths_ptr + slot * N + at, depth_of, mask=grafting)
        # (the mask built as a block: Triton's interpreter refuses a scalar
        # condition and'ed with a block's)
        words_grafted = (word < W) & (tl.zeros([BLOCK_W], tl.int64) + j < num_graft)
        tl.store(bits_ptr + (slot * N + at) * W + word, mask_bits, mask=words_grafted)
        if HAS_RANKS:  # a grafted node: only the whole tree has it
            tl.store(ranks_ptr + slot * N + at, (num_nodes - 2).to(tl.int64), mask=grafting)
    tl.atomic_add(counts_ptr, found.to(tl.int64))
    tl.atomic_add(counts_ptr + 1, num_graft.to(tl.int64))
