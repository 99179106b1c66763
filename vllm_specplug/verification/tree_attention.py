"""Tree attention over a paged KV cache: each draft-tree node attends to the
request's prefix and to its own ancestors (SpecInfer arXiv 2305.09781, EAGLE-2
arXiv 2406.16858).

The attention backend has already written every scheduled token's K/V at its
sequential slot (node i of a tree at position `seq_len + i`) and computed
causal attention. For requests whose tree is not a chain this overwrites the
output rows of their nodes. Kernel: `kernels/tree_attention.py`.

Cache views are vLLM 0.32's logical per-layer layout, split the way its CUDA
backends split it: `key_cache, value_cache = kv_cache.transpose(1, 2).split(
head_size, -1)`, each [num_blocks, block_size, num_kv_heads, head_size] with
any strides.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specplug.verification import checks
from vllm_specplug.verification.backend import (Backend, next_power_of_2, resolve_backend,
                                                triton_interpreted)
from vllm_specplug.verification.metadata import MASK_WORD_BITS
from vllm_specplug.verification.tree_build import pack_mask

BLOCK_M = 64  # most query rows (nodes x heads of one KV group) per program
BLOCK_N = 64  # key positions per tile
MIN_DOT = 16  # tl.dot's smallest tile side
MAX_SPLITS = 16  # key splits per row tile (flash-decoding) when programs are few
PROGRAMS_PER_SM = 2  # split until the grid has about this many programs per SM
SPLIT_BELOW_SM_FRACTION = 4  # ... only grids under a quarter of the SMs
KEY_SPLIT_CHOICES = (1, 2, 4, 8, 16)  # every value `num_key_splits` returns


@dataclass
class TreeAttentionMetadata:
    """One row per request of the step's batch (padding rows allowed)."""
    first_token: torch.Tensor  # [R] int32, the root's row in the step's query
    seq_lens: torch.Tensor  # [R] int32, the root's position (tokens cached before it)
    num_nodes: torch.Tensor  # [R] int32, tree nodes incl. the root; 0 = left to the backend
    ancestor_bits: torch.Tensor  # [R, N, W] int32, bit j%32 of word j//32 of row i: j is i or above it

    @property
    def max_nodes(self) -> int:
        return self.ancestor_bits.shape[1]


def metadata_from_masks(first_token, seq_lens, ancestor_masks: torch.Tensor,
                        num_nodes) -> TreeAttentionMetadata:
    """From dense [R, N, N] bool ancestor masks (node i sees j)."""
    as_int = lambda x: torch.as_tensor(x, dtype=torch.int32, device=ancestor_masks.device)
    return TreeAttentionMetadata(as_int(first_token), as_int(seq_lens), as_int(num_nodes),
                                 pack_mask(ancestor_masks))


def unpack_bits(bits: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """[R, N, W] int32 -> [R, N, num_nodes] bool."""
    j = torch.arange(num_nodes, device=bits.device)
    words = bits[..., j // MASK_WORD_BITS].long()
    return ((words >> (j % MASK_WORD_BITS)) & 1).bool()


def tree_attention_reference(query, key_cache, value_cache, block_table,
                             meta: TreeAttentionMetadata, scale: float, output) -> None:
    """Plain-PyTorch specification of `tree_attention` (float32 math, in place).
    query/output [T, num_heads, head_size]; block_table [R, max_blocks]."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for b in range(meta.num_nodes.shape[0]):
        n, seq_len = int(meta.num_nodes[b]), int(meta.seq_lens[b])
        if n == 0:
            continue
        first = int(meta.first_token[b])
        positions = torch.arange(seq_len + n, device=query.device)
        blocks = block_table[b, positions // block_size].long()
        keys = key_cache[blocks, positions % block_size].float().repeat_interleave(group, 1)
        values = value_cache[blocks, positions % block_size].float().repeat_interleave(group, 1)
        tree = unpack_bits(meta.ancestor_bits[b, :n], n)
        visible = torch.cat([torch.ones(n, seq_len, dtype=torch.bool, device=query.device),
                             tree], dim=1)
        scores = torch.einsum("nhd,lhd->hnl", query[first:first + n].float(), keys) * scale
        probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        output[first:first + n] = torch.einsum("hnl,lhd->nhd", probs, values).to(output.dtype)


def num_key_splits(num_programs: int, device: torch.device) -> int:
    """Key splits per row tile: 1 unless the grid would leave most SMs idle.
    At batch 1 a 16-node tree with GQA 4 is 8 programs (one per KV head),
    each reading the whole prefix; split 16 ways, as flash-decoding does, an
    8B-shaped step on the H100 went from 10.83 to 10.01 ms (vLLM's eagle3
    chain: 9.68-9.82). At batch 16 (128 programs) 4 splits measured slower
    (14.26 vs 12.46 ms), so grids of a quarter of the SMs or more run whole."""
    if device.type != "cuda" or num_programs <= 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if SPLIT_BELOW_SM_FRACTION * num_programs > sms:
        return 1
    return min(MAX_SPLITS, next_power_of_2(-(-PROGRAMS_PER_SM * sms // num_programs)))


def tree_attention_triton(query, key_cache, value_cache, block_table,
                          meta: TreeAttentionMetadata, scale: float, output,
                          num_requests: int | None = None, block_m: int | None = None,
                          block_n: int = BLOCK_N, num_warps: int = 4,
                          num_splits: int | None = None,
                          precision: str | None = None) -> None:
    """Launch over the first `num_requests` rows of `meta` (all by default);
    the tile sizes, warps and key splits are for benchmarks and tests
    (bench_tree_attention.py). By default a program's row tile just covers a
    tree's rows (nodes x group), at most BLOCK_M: a half-empty tile still
    reads the whole prefix (on an H100, 8-node trees with GQA 4: 0.11 vs
    0.16 ms per layer at batch 64 with 32-row tiles instead of 64;
    tree_attention_kernel.json), and the keys are split when the grid is
    small (`num_key_splits`). `precision`: `tl.dot`'s input precision for
    float32 ("ieee" by default; the engine passes the backend's own,
    `cuda_tree_attention.backend_dot_precision`)."""
    from vllm_specplug.kernels.tree_attention import (tree_attention_kernel,
                                                      tree_attention_merge_kernel)

    num_requests = meta.num_nodes.shape[0] if num_requests is None else num_requests
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if block_m is None:
        block_m = min(BLOCK_M, max(MIN_DOT, next_power_of_2(meta.max_nodes * group)))
    row_tiles = -(-meta.max_nodes * group // block_m)
    if num_splits is None:
        num_splits = num_key_splits(num_requests * num_kv_heads * row_tiles, query.device)
    head_pad = max(MIN_DOT, next_power_of_2(head_size))
    partial_out = query.new_empty((query.shape[0], num_heads, num_splits, head_pad)
                                  if num_splits > 1 else (1,), dtype=torch.float32)
    partial_lse = query.new_empty(partial_out.shape[:-1] if num_splits > 1 else (1,),
                                  dtype=torch.float32)
    precision = precision or ("ieee" if query.dtype == torch.float32 else "tf32")
    tree_attention_kernel[(num_requests, num_kv_heads, row_tiles * num_splits)](
        query, key_cache, value_cache, output, block_table, meta.first_token,
        meta.seq_lens, meta.num_nodes, meta.ancestor_bits, scale,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), meta.max_nodes, meta.ancestor_bits.shape[2], head_size,
        GROUP=group, HEAD_PAD=head_pad, BLOCK_SIZE=key_cache.shape[1], BLOCK_M=block_m,
        BLOCK_N=block_n, PRECISION=precision, UPCAST=triton_interpreted(),
        partial_out_ptr=partial_out, partial_lse_ptr=partial_lse, NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits, num_warps=num_warps)
    if num_splits > 1:
        tree_attention_merge_kernel[(num_requests, num_kv_heads, row_tiles)](
            output, partial_out, partial_lse, meta.first_token, meta.num_nodes,
            output.stride(0), output.stride(1), head_size, num_heads, GROUP=group,
            HEAD_PAD=head_pad, BLOCK_M=block_m, NUM_SPLITS=num_splits)


def tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, meta: TreeAttentionMetadata, scale: float,
                   output: torch.Tensor, backend: Backend = "auto",
                   validate: bool = True) -> None:
    """Overwrite `output` [T, num_heads, head_size] rows of every request with
    `num_nodes > 0` with its nodes' tree attention (in place).

    query [T, num_heads, head_size]; key_cache / value_cache [num_blocks,
    block_size, num_kv_heads, head_size] (strided views allowed, last dim
    contiguous); block_table [R, max_blocks] int32."""
    if validate:
        _check_inputs(query, key_cache, value_cache, block_table, meta, output)
    if resolve_backend(backend, query) == "triton":
        tree_attention_triton(query, key_cache, value_cache, block_table, meta, scale, output)
    else:
        tree_attention_reference(query, key_cache, value_cache, block_table, meta, scale,
                                 output)


def _check_inputs(query, key_cache, value_cache, block_table, meta, output) -> None:
    checks.check_same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                             block_table=block_table, ancestor_bits=meta.ancestor_bits,
                             output=output)
    checks.check_shape("query", query, (None, None, None))
    checks.check_shape("output", output, tuple(query.shape))
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    checks.check_shape("key_cache", key_cache, (None, None, None, query.shape[2]))
    checks.check_shape("value_cache", value_cache, tuple(key_cache.shape))
    if query.shape[1] % num_kv_heads:
        raise checks.VerificationInputError(
            f"query has {query.shape[1]} heads, not a multiple of the cache's "
            f"{num_kv_heads} KV heads")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or query.stride(2) != 1:
        raise checks.VerificationInputError("query and caches need a contiguous last dim")
    _check_metadata(meta, block_table, block_size, num_blocks, query.shape[0])


def _check_metadata(meta, block_table, block_size, num_blocks, num_tokens) -> None:
    rows = meta.num_nodes.shape[0]
    for name in ("first_token", "seq_lens", "num_nodes"):
        checks.check_shape(f"meta.{name}", getattr(meta, name), (rows,))
        checks.check_dtype(f"meta.{name}", getattr(meta, name), (torch.int32,))
    if not all(t.is_contiguous() for t in vars(meta).values()):
        raise checks.VerificationInputError(
            "meta tensors must be contiguous (the kernel indexes them by request row)")
    words = -(-meta.max_nodes // MASK_WORD_BITS)
    checks.check_shape("meta.ancestor_bits", meta.ancestor_bits, (rows, None, words))
    checks.check_shape("block_table", block_table, (rows, None))
    checks.check_range("meta.num_nodes", meta.num_nodes, 0, meta.max_nodes + 1)
    checks.check_range("meta.seq_lens", meta.seq_lens, 0, block_table.shape[1] * block_size)
    live = meta.num_nodes > 0
    ends = meta.first_token + meta.num_nodes
    checks.check_range("meta.first_token + meta.num_nodes", ends[live], 1, num_tokens + 1)
    kv_ends = (meta.seq_lens + meta.num_nodes)[live]
    checks.check_range("meta.seq_lens + meta.num_nodes", kv_ends, 1,
                       block_table.shape[1] * block_size + 1)
    for b in live.nonzero().flatten().tolist():
        used = -(-int(meta.seq_lens[b] + meta.num_nodes[b]) // block_size)
        checks.check_range(f"block_table[{b}]", block_table[b, :used], 0, num_blocks)
