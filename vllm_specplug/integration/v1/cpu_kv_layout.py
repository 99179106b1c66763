"""Where vLLM's CPU attention kernel keeps each token's K and V inside a block.

vLLM's CPU cache is [num_blocks, num_kv_heads, block_size, 2 * head_size]
memory, but `cpu_attn_reshape_and_cache` stores keys in an ISA-specific
order (e.g. transposed [head_size, block_size] per head for "vec"/"vec16",
tiled for AMX), undocumented and free to change. Instead of hard-coding it,
we probe it once per (isa, shape, dtype) with the kernel's own write op:
one write per bit of the element index, values 0/1 (exact in every float
dtype), then read which flat offset of the block each (token, head, dim)
landed on. Reads and writes of single tokens (tree attention, KV compaction)
then index the block memory with that map.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class BlockLayout:
    key_index: torch.Tensor  # [block_size, kv_heads, head_size] int64 offsets in a block
    value_index: torch.Tensor  # [block_size, kv_heads, head_size] int64

    @property
    def block_size(self) -> int:
        return self.key_index.shape[0]

    def _flat(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache.view(kv_cache.shape[0], -1)

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor):
        """K, V [S, kv_heads, head_size] of the tokens at `slots` [S]."""
        flat, size = self._flat(kv_cache), self.block_size
        blocks = (slots // size)[:, None, None]
        offsets = slots % size
        return flat[blocks, self.key_index[offsets]], flat[blocks, self.value_index[offsets]]

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys, values) -> None:
        flat, size = self._flat(kv_cache), self.block_size
        blocks = (slots // size)[:, None, None]
        offsets = slots % size
        flat[blocks, self.key_index[offsets]] = keys
        flat[blocks, self.value_index[offsets]] = values


class LayoutProbeError(RuntimeError):
    """The kernel's write did not place every element exactly once."""


@lru_cache(maxsize=None)
def probe_layout(isa: str, block_size: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype) -> BlockLayout:
    from vllm import _custom_ops as ops

    cache = torch.zeros(1, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(1, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    index = torch.arange(block_size * num_kv_heads * head_size).view(
        block_size, num_kv_heads, head_size)
    slots = torch.arange(block_size)
    maps = []
    for probe_keys in (True, False):
        code = torch.zeros(cache.numel(), dtype=torch.int64)
        for bit in range(int(index.max()).bit_length()):
            plane = ((index >> bit) & 1).to(dtype)
            cache.zero_()
            keys, values = (plane, torch.zeros_like(plane)) if probe_keys else \
                (torch.zeros_like(plane), plane)
            ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
            code |= (cache.view(-1) != 0).long() << bit
        maps.append(_invert(code, cache, index, isa, probe_keys, dtype))
    return BlockLayout(*maps)


def _invert(code, cache, index, isa, probe_keys, dtype) -> torch.Tensor:
    """Flat offset of each element, from the code found at each offset."""
    cache.zero_()
    ones = torch.ones(index.shape, dtype=dtype)
    key_cache, value_cache = cache.view(1, cache.shape[1], -1, cache.shape[-1] // 2).chunk(2, 2)
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(ones if probe_keys else ones * 0,
                                   ones * 0 if probe_keys else ones,
                                   key_cache, value_cache, torch.arange(index.shape[0]), isa)
    written = (cache.view(-1) != 0).nonzero().squeeze(1)
    offsets = torch.full((index.numel(),), -1, dtype=torch.int64)
    offsets[code[written]] = written
    if len(written) != index.numel() or (offsets < 0).any():
        raise LayoutProbeError(f"CPU KV layout probe for isa={isa!r} found "
                               f"{len(written)} written offsets for {index.numel()} elements")
    return offsets.view(index.shape)


# Layout of each layer's cache, by storage address, for KV compaction (which
# runs in the sampler, where no layer is at hand).
_LAYOUTS: dict[int, BlockLayout] = {}


def layout_of(kv_cache: torch.Tensor, isa: str) -> BlockLayout:
    """The layout of a CPU-backend cache [num_blocks, kv_heads, block_size,
    2 * head_size], remembered for `known_layout`."""
    _, num_kv_heads, block_size, twice = kv_cache.shape
    layout = probe_layout(isa, block_size, num_kv_heads, twice // 2, kv_cache.dtype)
    _LAYOUTS[kv_cache.data_ptr()] = layout
    return layout


def known_layout(kv_cache: torch.Tensor) -> BlockLayout | None:
    return _LAYOUTS.get(kv_cache.data_ptr())
