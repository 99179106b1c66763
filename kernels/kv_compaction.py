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
def compact_kv_cache_kernel(cache_ptr, block_table_ptr, seq_len_ptr,
                            accepted_node_ptr, num_accepted_ptr, plane_stride,
                            max_blocks, N, BLOCK_SIZE, ROW, BLOCK: tl.constexpr,
                            GROUP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    plane = cache_ptr + tl.program_id(1).to(tl.int64) * plane_stride
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < ROW
    table = block_table_ptr + b * max_blocks
    seq_len = tl.load(seq_len_ptr + b)
    num = tl.load(num_accepted_ptr + b)
    for j0 in range(1, num + 1, GROUP):
        j = j0 + tl.arange(0, GROUP)
        live = j <= num
        node = tl.load(accepted_node_ptr + b * N + j, mask=live, other=0)
        move = live & (node != j)
        src = _slot(table, seq_len + node, move, BLOCK_SIZE)
        dst = _slot(table, seq_len + j, move, BLOCK_SIZE)
        tile = move[:, None] & in_row[None, :]
        rows = tl.load(plane + src[:, None] * ROW + offs[None, :], mask=tile)
        tl.debug_barrier()
        tl.store(plane + dst[:, None] * ROW + offs[None, :], rows, mask=tile)
