"""Triton kernels: a tree step's rows on Model Runner V2, on the device.

Wrappers and references: `vllm_specplug/verification/tree_rows.py`.

`prepare_tree_rows_kernel` (before the target's forward): for each request
row of the batch whose query is a drafted tree (its logits rows equal its
query rows, more than one), rewrite the rope positions of its nodes from
`seq_len + i` to `seq_len + depth(i)` (vLLM already computed the KV slots
from the sequential positions, which stay) and write the tree-attention row:
first query row, the root's position, node count, ancestor bits. Every
other row, padding included, gets `num_nodes = 0` (left to the backend).
One program per row of the persistent buffers.

`verified_rows_kernel` (after verification, for the drafter's ingest): for
each decoding request, its verified positions padded to R rows by repeating
the last one: the query row each reads its target hidden state from, the
position, and the token that follows it; and the root of its next draft (the
token sampled after them, and its position). Programs past the requests
repeat the last request, so a batch padded to a capture size is laid out in
the same launch.
"""
import triton
import triton.language as tl


# `num_reqs` moves with the batch, so it is not specialized on:
# Triton compiles a variant per value class (1, a multiple of 16, other)
# on first use, which a served engine met in its first requests
# (docs/results/batch_draft_length_h200_run12)
@triton.jit(do_not_specialize=["num_reqs"])
def prepare_tree_rows_kernel(positions_ptr, query_start_ptr, cu_num_logits_ptr,
                             idx_mapping_ptr, slot_is_tree_ptr, slot_depths_ptr,
                             slot_bits_ptr, first_token_ptr, seq_lens_ptr, num_nodes_ptr,
                             bits_ptr, num_reqs, N: tl.constexpr, N_PAD: tl.constexpr,
                             W: tl.constexpr):
    row = tl.program_id(0)
    if row >= num_reqs:
        tl.store(num_nodes_ptr + row, 0)
        return
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    first = tl.load(query_start_ptr + row)
    num_query = tl.load(query_start_ptr + row + 1) - first
    num_logits = tl.load(cu_num_logits_ptr + row + 1) - tl.load(cu_num_logits_ptr + row)
    is_tree = tl.load(slot_is_tree_ptr + slot) != 0
    if is_tree and num_logits > 1 and num_logits == num_query and num_query <= N:
        node = tl.arange(0, N_PAD)
        live = node < num_query
        root_position = tl.load(positions_ptr + first)
        depth = tl.load(slot_depths_ptr + slot * N + node, mask=live, other=0)
        tl.store(positions_ptr + first + node, root_position + depth, mask=live)
        tl.store(first_token_ptr + row, first)
        tl.store(seq_lens_ptr + row, root_position.to(tl.int32))
        tl.store(num_nodes_ptr + row, num_query)
        for w in range(W):
            bits = tl.load(slot_bits_ptr + (slot * N + node) * W + w, mask=live, other=0)
            tl.store(bits_ptr + (row * N + node) * W + w, bits, mask=node < N)
    else:
        tl.store(num_nodes_ptr + row, 0)


# `num_requests` moves with the batch and `N` with the draft length, so
# neither is specialized on:
# Triton compiles a variant per value class (1, a multiple of 16, other)
# on first use, which a served engine met in its first requests
# (docs/results/batch_draft_length_h200_run12)
@triton.jit(do_not_specialize=["num_requests", "N"])
def verified_rows_kernel(batch_rows_ptr, query_start_ptr, seq_lens_ptr, num_rejected_ptr,
                         cu_num_logits_ptr, idx_mapping_ptr, accepted_node_ptr,
                         input_ids_ptr, last_sampled_ptr, token_rows_ptr, positions_ptr,
                         next_ids_ptr, slots_ptr, cuts_ptr, root_ids_ptr, root_positions_ptr,
                         num_requests, N, R: tl.constexpr, USE_NODES: tl.constexpr):
    # programs past the requests repeat the last one (padding to a capture size)
    p = tl.program_id(0)
    b = tl.load(batch_rows_ptr + tl.minimum(p, num_requests - 1)).to(tl.int64)
    first = tl.load(query_start_ptr + b)
    num_query = tl.load(query_start_ptr + b + 1) - first
    first_position = tl.load(seq_lens_ptr + b) - num_query
    num_verified = num_query - tl.load(num_rejected_ptr + b)
    num_drafts = tl.load(cu_num_logits_ptr + b + 1) - tl.load(cu_num_logits_ptr + b) - 1
    base = num_query - num_drafts  # rows before the drafts (the root is the last)
    slot = tl.load(idx_mapping_ptr + b).to(tl.int64)
    r = tl.arange(0, R)
    j = tl.minimum(r, num_verified - 1)
    offset = j
    nxt = tl.minimum(j + 1, num_verified - 1)
    next_offset = nxt
    if USE_NODES:  # a tree: verified drafts sit at their accepted nodes
        in_tree = j >= base - 1
        node = tl.load(accepted_node_ptr + b * N + j - (base - 1), mask=in_tree, other=0)
        offset = tl.where(in_tree, base - 1 + node, j)
        next_in = nxt >= base - 1
        next_node = tl.load(accepted_node_ptr + b * N + nxt - (base - 1), mask=next_in,
                            other=0)
        next_offset = tl.where(next_in, base - 1 + next_node, nxt)
    following = tl.load(input_ids_ptr + first + next_offset)
    last = tl.load(last_sampled_ptr + slot)
    tl.store(token_rows_ptr + p * R + r, first + offset)
    tl.store(positions_ptr + p * R + r, first_position + j)
    tl.store(next_ids_ptr + p * R + r, tl.where(j + 1 < num_verified, following, last))
    tl.store(slots_ptr + p, slot)
    tl.store(cuts_ptr + p, first_position)
    # the next tree's root: the token sampled after the verified positions
    tl.store(root_ids_ptr + p, last)
    tl.store(root_positions_ptr + p, first_position + num_verified)
