"""Triton kernel: move accepted tree nodes' KV into consecutive positions.

Wrapper and reference: `vllm_specplug/verification/kv_compaction.py`.
Grid (B, planes, row chunks). Moves go in ascending groups of GROUP: along a
path node_j >= j, so no move's source is an earlier move's destination, and
every source can be read before the group writes. A destination may be the
source of an earlier move in the same group, hence the barrier between the
group's loads and stores (another thread may own that element).
"""
import triton
import triton.language as tl


@triton.jit
def _slot(block_table_ptr, position, live, BLOCK_SIZE):
    block = tl.load(block_table_ptr + position // BLOCK_SIZE, mask=live, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + position % BLOCK_SIZE


@triton.jit
def _move_path(plane, table, root, accepted_node_ptr, num, offs, in_row, BLOCK_SIZE, ROW,
               GROUP: tl.constexpr):
    """Rows of nodes accepted_node[1..num] to root + 1..num, in one plane."""
    for j0 in range(1, num + 1, GROUP):
        j = j0 + tl.arange(0, GROUP)
        live = j <= num
        node = tl.load(accepted_node_ptr + j, mask=live, other=0)
        move = live & (node != j)
        src = _slot(table, root + node, move, BLOCK_SIZE)
        dst = _slot(table, root + j, move, BLOCK_SIZE)
        tile = move[:, None] & in_row[None, :]
        rows = tl.load(plane + src[:, None] * ROW + offs[None, :], mask=tile)
        tl.debug_barrier()
        tl.store(plane + dst[:, None] * ROW + offs[None, :], rows, mask=tile)


# `N` moves with the draft length, so it is not specialized on:
# Triton compiles a variant per value class (1, a multiple of 16, other)
# on first use, which a served engine met in its first requests
# (docs/results/batch_draft_length_h200_run12)
@triton.jit(do_not_specialize=["N"])
def compact_kv_cache_kernel(cache_ptr, block_table_ptr, seq_len_ptr,
                            accepted_node_ptr, num_accepted_ptr, plane_stride,
                            max_blocks, N, BLOCK_SIZE, ROW, BLOCK: tl.constexpr,
                            GROUP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    plane = cache_ptr + tl.program_id(1).to(tl.int64) * plane_stride
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    _move_path(plane, block_table_ptr + b * max_blocks, tl.load(seq_len_ptr + b),
               accepted_node_ptr + b * N, tl.load(num_accepted_ptr + b), offs, offs < ROW,
               BLOCK_SIZE, ROW, GROUP)


# as compact_kv_cache_kernel: `N` not specialized on
@triton.jit(do_not_specialize=["N"])
def compact_kv_layers_kernel(cache_ptr, layer_offset_ptr, block_table_ptr, seq_len_ptr,
                             query_start_ptr, accepted_node_ptr, num_accepted_ptr,
                             max_blocks, N, BLOCK_SIZE, ROW, BLOCK: tl.constexpr,
                             GROUP: tl.constexpr):
    """Every layer in one launch, grid (B, layers, row chunks): layer l's
    cache starts layer_offset[l] elements from cache_ptr (one dtype and
    layout for all). The root sits at seq_len - query length, read from the
    runner's own rows rather than computed by the caller."""
    b = tl.program_id(0).to(tl.int64)
    plane = cache_ptr + tl.load(layer_offset_ptr + tl.program_id(1))
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    query_len = tl.load(query_start_ptr + b + 1) - tl.load(query_start_ptr + b)
    root = (tl.load(seq_len_ptr + b) - query_len).to(tl.int64)
    _move_path(plane, block_table_ptr + b * max_blocks, root, accepted_node_ptr + b * N,
               tl.load(num_accepted_ptr + b), offs, offs < ROW, BLOCK_SIZE, ROW, GROUP)
