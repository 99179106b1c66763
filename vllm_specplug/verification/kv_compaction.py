"""KV compaction after tree verification.

During verification node i of a request's tree was written at position
`seq_len + i` of the paged KV cache. After acceptance the path
root = n_0, n_1, ..., n_m must sit at positions `seq_len + 0..m`; this moves
node n_j's K and V to position `seq_len + j` and leaves every other slot
untouched. Slots follow vLLM's block-table layout:
`slot(pos) = block_table[b, pos // block_size] * block_size + pos % block_size`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specplug.verification import checks
from vllm_specplug.verification.backend import Backend, resolve_backend

ROW_BLOCK = 1024
MOVE_GROUP = 4  # moves read together before they write (see the kernel)


def _planes(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., num_blocks, block_size, H, D] -> [planes, num_slots, H * D] view."""
    *lead, num_blocks, _, heads, head_size = kv_cache.shape
    return kv_cache.view(-1, num_blocks * block_size, heads * head_size)


def _slot(block_table: torch.Tensor, b: int, position: int, block_size: int) -> int:
    return int(block_table[b, position // block_size]) * block_size + position % block_size


def compact_kv_cache_reference(kv_cache, block_table, seq_lens, accepted_node_ids,
                               num_accepted) -> None:
    """Plain-PyTorch specification of `compact_kv_cache` (in place)."""
    block_size = kv_cache.shape[-3]
    planes = _planes(kv_cache, block_size)
    for b in range(block_table.shape[0]):
        seq_len = int(seq_lens[b])
        for j in range(1, int(num_accepted[b]) + 1):
            node = int(accepted_node_ids[b, j])
            if node != j:
                src = _slot(block_table, b, seq_len + node, block_size)
                dst = _slot(block_table, b, seq_len + j, block_size)
                planes[:, dst] = planes[:, src]


def _check_path(accepted_node_ids: torch.Tensor, num_accepted: torch.Tensor) -> None:
    batch, num_nodes = accepted_node_ids.shape
    checks.check_range("num_accepted", num_accepted, 0, num_nodes)
    index = torch.arange(num_nodes, device=accepted_node_ids.device)
    on_path = index[None, :] <= num_accepted[:, None]
    nodes = torch.where(on_path, accepted_node_ids, index[None, :])
    increasing = (nodes[:, 1:] > nodes[:, :-1]) | ~on_path[:, 1:]
    if (nodes[:, 0] != 0).any() or not increasing.all() or (nodes >= num_nodes).any():
        raise checks.VerificationInputError(
            "accepted_node_ids must start at the root (0) and increase along the "
            "accepted path, within the tree (as verification returns them)")


def _check_compaction_inputs(kv_cache, block_table, seq_lens, accepted_node_ids,
                             num_accepted) -> None:
    if kv_cache.dim() < 4 or not kv_cache.is_contiguous():
        raise checks.VerificationInputError(
            f"kv_cache has shape {list(kv_cache.shape)}: expected a contiguous "
            "[..., num_blocks, block_size, num_kv_heads, head_size] tensor")
    num_blocks, block_size = kv_cache.shape[-4], kv_cache.shape[-3]
    checks.check_shape("block_table", block_table, (None, None))
    batch, max_blocks = block_table.shape
    checks.check_dtype("block_table", block_table, (torch.int32, torch.int64))
    checks.check_shape("seq_lens", seq_lens, (batch,))
    checks.check_shape("accepted_node_ids", accepted_node_ids, (batch, None))
    checks.check_shape("num_accepted", num_accepted, (batch,))
    for name, tensor in (("seq_lens", seq_lens), ("num_accepted", num_accepted),
                         ("accepted_node_ids", accepted_node_ids)):
        checks.check_dtype(name, tensor, (torch.int64,))
    checks.check_same_device(kv_cache=kv_cache, block_table=block_table,
                             seq_lens=seq_lens, accepted_node_ids=accepted_node_ids)
    _check_path(accepted_node_ids, num_accepted)
    last = seq_lens + accepted_node_ids.shape[1] - 1
    checks.check_range("seq_lens + num_nodes - 1", last, 0, max_blocks * block_size)
    used = block_table[:, :int(last.max()) // block_size + 1] if batch else block_table
    checks.check_range("block_table", used, 0, num_blocks)


def compact_kv_cache(kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, accepted_node_ids: torch.Tensor,
                     num_accepted: torch.Tensor, backend: Backend = "auto",
                     validate: bool = True) -> None:
    """Move accepted nodes' KV to consecutive positions, in place.

    Args:
        kv_cache: [..., num_blocks, block_size, H, D], e.g. vLLM's per-layer
            [2, num_blocks, block_size, H, D] or all layers stacked; every
            leading plane is moved alike.
        block_table: [B, max_blocks] int32/int64.
        seq_lens: [B] int64, position of each tree's root.
        accepted_node_ids: [B, N] int64 and num_accepted [B] int64, as returned
            by tree verification (`VerifyOutput`).
        validate: check inputs first (host syncs).
    """
    if validate:
        _check_compaction_inputs(kv_cache, block_table, seq_lens, accepted_node_ids,
                                 num_accepted)
    if resolve_backend(backend, kv_cache) == "torch":
        return compact_kv_cache_reference(kv_cache, block_table, seq_lens,
                                          accepted_node_ids, num_accepted)
    from vllm_specplug.kernels.kv_compaction import compact_kv_cache_kernel

    block_size = kv_cache.shape[-3]
    planes = _planes(kv_cache, block_size)
    num_planes, _, row = planes.shape
    grid = (block_table.shape[0], num_planes, -(-row // ROW_BLOCK))
    compact_kv_cache_kernel[grid](
        planes, block_table.contiguous(), seq_lens.contiguous(),
        accepted_node_ids.contiguous(), num_accepted.contiguous(),
        planes.stride(0), block_table.shape[1], accepted_node_ids.shape[1],
        block_size, row, BLOCK=min(ROW_BLOCK, 1 << (row - 1).bit_length()),
        GROUP=MOVE_GROUP)


@dataclass
class KVLayers:
    """Every attention layer's cache, of one shape and dtype, addressed from
    the first: the compaction of all layers is one launch, not one a layer."""
    caches: list[torch.Tensor]  # each [..., num_blocks, block_size, H, D], contiguous
    plane_offsets: torch.Tensor  # [layers * planes] int64, elements from caches[0]


def kv_layers(caches: list[torch.Tensor]) -> KVLayers | None:
    """The caches as one `KVLayers`, or None where they differ in shape or
    dtype, or are not contiguous (compact them one by one then)."""
    if not caches or any(c.shape != caches[0].shape or c.dtype != caches[0].dtype
                         or not c.is_contiguous() for c in caches):
        return None
    base, size = caches[0].data_ptr(), caches[0].element_size()
    planes = _planes(caches[0], caches[0].shape[-3])
    offsets = [(c.data_ptr() - base) // size + p * planes.stride(0)
               for c in caches for p in range(planes.shape[0])]
    if any((c.data_ptr() - base) % size for c in caches):
        return None
    return KVLayers(caches, torch.tensor(offsets, dtype=torch.int64, device=caches[0].device))


def compact_kv_layers(layers: KVLayers, block_table: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      accepted_node_ids: torch.Tensor, num_accepted: torch.Tensor,
                      backend: Backend = "auto") -> None:
    """`compact_kv_cache` on every layer, in place, in one launch; the roots
    are the runner's: seq_lens[b] - query length (query_start_loc [B + 1]).

    Args:
        block_table: [B, max_blocks] int32/int64.
        query_start_loc: [>= B + 1] int32, seq_lens: [>= B] int32, of the step.
        accepted_node_ids: [B, N] int64 and num_accepted [B] int64, as
            verification returns them.
    """
    batch = accepted_node_ids.shape[0]
    if resolve_backend(backend, accepted_node_ids) == "torch":
        starts = query_start_loc[:batch + 1].long()
        roots = seq_lens[:batch].long() - (starts[1:] - starts[:-1])
        for cache in layers.caches:
            compact_kv_cache_reference(cache, block_table, roots, accepted_node_ids,
                                       num_accepted)
        return
    from vllm_specplug.kernels.kv_compaction import compact_kv_layers_kernel

    planes = _planes(layers.caches[0], layers.caches[0].shape[-3])
    row = planes.shape[2]
    grid = (batch, layers.plane_offsets.shape[0], -(-row // ROW_BLOCK))
    compact_kv_layers_kernel[grid](
        planes, layers.plane_offsets, block_table.contiguous(), seq_lens, query_start_loc,
        accepted_node_ids.contiguous(), num_accepted.contiguous(), block_table.shape[1],
        accepted_node_ids.shape[1], layers.caches[0].shape[-3], row,
        BLOCK=min(ROW_BLOCK, 1 << (row - 1).bit_length()), GROUP=MOVE_GROUP)
