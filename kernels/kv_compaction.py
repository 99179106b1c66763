"""Triton kernel: move accepted tree nodes' KV into consecutive positions.

Wrapper and reference: `vllm_specplug/verification/kv_compaction.py`.
Grid (B, planes, row chunks). Within a request the moves run in ascending
order: accepted node ids increase along a path (node_j >= j), so a move never
overwrites a source that a later move still has to read.
"""
import triton
import triton.language as tl


@triton.jit
def _slot(block_table_ptr, position, BLOCK_SIZE):
    block = tl.load(block_table_ptr + position // BLOCK_SIZE).to(tl.int64)
    return block * BLOCK_SIZE + position % BLOCK_SIZE


@triton.jit
def compact_kv_cache_kernel(cache_ptr, block_table_ptr, seq_len_ptr,
                            accepted_node_ptr, num_accepted_ptr, plane_stride,
                            max_blocks, N, BLOCK_SIZE, ROW, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    plane = cache_ptr + tl.program_id(1).to(tl.int64) * plane_stride
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < ROW
    table = block_table_ptr + b * max_blocks
    seq_len = tl.load(seq_len_ptr + b)
    num = tl.load(num_accepted_ptr + b)
    for j in range(1, num + 1):
        node = tl.load(accepted_node_ptr + b * N + j)
        if node != j:
            src = _slot(table, seq_len + node, BLOCK_SIZE)
            dst = _slot(table, seq_len + j, BLOCK_SIZE)
            row = tl.load(plane + src * ROW + offs, mask=in_row)
            tl.store(plane + dst * ROW + offs, row, mask=in_row)
