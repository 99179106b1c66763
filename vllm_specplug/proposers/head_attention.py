"""The draft head's attention over its cache pool (`head_cache.py`), read in
place.

`slot_attention(queries, pool, slots, positions, num_keys, scale, path_kv)`:
query rows [G, T, nh, hd] of G requests, request g's cache in pool slot
slots[g] ([G] int64). Row (g, t) attends to the slot's valid keys at
indices <= positions[g, t] and < num_keys ([G, T] int64; negative: a
padding row, its output is 0), then to its own path keys path_kv =
(path_k, path_v) [G, T, kvh, D, hd] each (a draft node's ancestors and
itself; None for an ingest). Returns [G, T, nh, hd] in the queries' dtype.

On CUDA one Triton kernel per call (`kernels/head_attention.py`) reads the
pool in place and stops at each tile's last position. Elsewhere the
PyTorch reference runs: it copies the slots' keys out of the pool and
attends with einsums over all num_keys, in float32 math.

The head runtime (`eagle3_head.py`) calls `attend_cached` (an ingest's
causal rows) and `attend_draft` (a draft node over the cache and its path,
with `draft_context` made once per drafting pass). Off CUDA these keep the
runtime's own einsums in the pool's dtype (softmax in float32), which the
CPU results were measured with; on CUDA they call the kernel.

Shapes: G (or B) requests, T query rows each, nh query heads, kvh KV heads
(g = nh / kvh), hd head size, L = num_keys, D path keys.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_specplug.verification.backend import (Backend, next_power_of_2, resolve_backend,
                                                triton_interpreted)
from vllm_specplug.verification.tree_attention import MIN_DOT

MAX_ROW_TILE = 64  # query rows (tokens x heads of one KV group) per program
BLOCK_KEYS = 64  # keys a program reads at a time
ROW_TILES = tuple(MIN_DOT << i for i in range((MAX_ROW_TILE // MIN_DOT).bit_length()))  # 16-64


def slot_attention_reference(queries: torch.Tensor, pool, slots: torch.Tensor,
                             positions: torch.Tensor, num_keys: int, scale: float,
                             path_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                             ) -> torch.Tensor:
    """The plain-PyTorch specification (float32 math); see the module."""
    num_groups, num_rows, num_heads, head_size = queries.shape
    group = num_heads // pool.keys.shape[1]
    num_keys = min(num_keys, pool.keys.shape[2])
    keys = pool.keys[slots, :, :num_keys].float().repeat_interleave(group, 1)  # [G, nh, L, hd]
    values = pool.values[slots, :, :num_keys].float().repeat_interleave(group, 1)
    visible = pool.valid[slots, :num_keys][:, None, :] & (
        torch.arange(num_keys, device=slots.device)[None, None, :]
        <= positions[:, :, None])  # [G, T, L]
    scores = torch.einsum("gthd,ghld->gthl", queries.float(), keys) * scale
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    parts = [values[:, None].expand(-1, num_rows, -1, -1, -1)]  # [G, T, nh, L, hd]
    if path_kv is not None:
        path_k, path_v = (t.float().repeat_interleave(group, 2) for t in path_kv)
        path_scores = torch.einsum("gthd,gthnd->gthn", queries.float(), path_k) * scale
        live = (positions >= 0)[:, :, None, None]
        scores = torch.cat([scores, path_scores.masked_fill(~live, float("-inf"))], -1)
        parts.append(path_v)
    probs = scores.softmax(-1).nan_to_num(0.0)  # a padding row sees nothing: 0
    out = torch.einsum("gthl,gthld->gthd", probs, torch.cat(parts, 3))
    return out.to(queries.dtype)


def row_tile(num_rows: int, group: int) -> int:
    """The kernel's BLOCK_M for `num_rows` query rows of `group` heads a KV
    head: a compiled variant of the kernel each (kernel_warmup.py warms them)."""
    return min(MAX_ROW_TILE, max(MIN_DOT, next_power_of_2(num_rows * group)))


def slot_attention(queries: torch.Tensor, pool, slots: torch.Tensor, positions: torch.Tensor,
                   num_keys: int, scale: float,
                   path_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                   backend: Backend = "auto") -> torch.Tensor:
    """See the module docstring. No host sync: a CUDA graph can capture it."""
    if resolve_backend(backend, queries) == "torch":
        return slot_attention_reference(queries, pool, slots, positions, num_keys, scale,
                                        path_kv)
    from vllm_specplug.kernels.head_attention import head_attention_kernel

    num_groups, num_rows, num_heads, head_size = queries.shape
    keys, values, valid = pool.keys, pool.values, pool.valid
    if keys.stride() != values.stride() or keys.stride(-1) != 1:
        raise ValueError("slot_attention: the pool's keys and values need one contiguous "
                         "layout [S, kvh, C, hd]")
    group = num_heads // keys.shape[1]
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    out = torch.empty_like(queries, memory_format=torch.contiguous_format)
    path_k, path_v = path_kv if path_kv is not None else (queries[:, :, None], queries[:, :, None])
    num_path = path_k.shape[3] if path_kv is not None else 0
    if path_kv is not None and (path_k.stride() != path_v.stride() or path_k.stride(-1) != 1):
        path_k, path_v = path_k.contiguous(), path_v.contiguous()
    block_m = row_tile(num_rows, group)
    grid = (num_groups, keys.shape[1], -(-num_rows * group // block_m))
    if num_groups and num_rows:
        head_attention_kernel[grid](
            queries, keys, values, valid, slots, positions, path_k, path_v, out,
            scale, min(num_keys, keys.shape[2]), num_rows, num_path,
            queries.stride(0), queries.stride(1), queries.stride(2),
            keys.stride(0), keys.stride(1), keys.stride(2), valid.stride(0),
            positions.stride(0), positions.stride(1),
            path_k.stride(0), path_k.stride(1), path_k.stride(2), path_k.stride(3),
            out.stride(0), out.stride(1), out.stride(2), head_size,
            GROUP=group, HEAD_PAD=max(MIN_DOT, next_power_of_2(head_size)), BLOCK_M=block_m,
            BLOCK_N=BLOCK_KEYS, PRECISION="ieee" if queries.dtype == torch.float32 else "tf32",
            UPCAST=triton_interpreted())
    return out


class SlotsContext(NamedTuple):
    """A drafting pass's context when the kernel reads the pool in place."""
    slots: torch.Tensor  # [B] int64
    num_keys: int


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in float32 (bf16 sums of many keys drift),
    returned in the scores' dtype for the value product."""
    return scores.float().softmax(-1).to(scores.dtype)


def attend_cached(queries: torch.Tensor, pool, index: torch.Tensor, positions: torch.Tensor,
                  num_keys: int, scale: float, backend: Backend = "auto") -> torch.Tensor:
    """queries [G, T, kvh, g, hd] at positions [G, T] (negative: padding)
    over the cached keys < num_keys of slots index [G], causal. Returns
    [G, T, nh, hd]."""
    if resolve_backend(backend, queries) == "triton":
        return slot_attention(queries.flatten(2, 3), pool, index, positions, num_keys, scale,
                              backend="triton")
    keys, values = pool.keys[index, :, :num_keys], pool.values[index, :, :num_keys]
    allowed = pool.valid[index, :num_keys][:, None, :] & (
        torch.arange(num_keys, device=index.device)[None, None, :]
        <= positions[:, :, None])  # [G, T, L]
    scores = torch.einsum("gtcjd,gcld->gcjtl", queries, keys) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    out = torch.einsum("gcjtl,gcld->gtcjd", _softmax(scores), values)
    return out.flatten(2, 3)


def draft_context(pool, slots: torch.Tensor, num_keys: int, backend: Backend = "auto"):
    """What a drafting pass reads of its slots' caches, once for all of its
    steps: for the kernel, the slots (`SlotsContext`); otherwise copies of
    their keys, values [B, kvh, L, hd] and an additive mask [B, L] (0 where
    valid, -inf where not)."""
    if resolve_backend(backend, pool.keys) == "triton":
        return SlotsContext(slots, num_keys)
    valid = pool.valid[slots, :num_keys]
    bias = torch.zeros(valid.shape, dtype=pool.keys.dtype, device=valid.device)
    return (pool.keys[slots, :, :num_keys], pool.values[slots, :, :num_keys],
            bias.masked_fill_(~valid, float("-inf")))


def attend_draft(ctx, pool, queries: torch.Tensor, path_kv: tuple[torch.Tensor, torch.Tensor],
                 positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Draft nodes' queries [B, k, nh, hd] at positions [B, k] over their
    request's cache (`ctx` from `draft_context`) and their own path K/V
    [B, k, kvh, D, hd] each. Returns [B, k, nh, hd]."""
    if isinstance(ctx, SlotsContext):
        return slot_attention(queries, pool, ctx.slots, positions, ctx.num_keys, scale,
                              path_kv, backend="triton")
    keys_ctx, values_ctx, ctx_bias = ctx
    (path_k, path_v), (batch, width) = path_kv, queries.shape[:2]
    q = (queries * scale).view(batch, width, keys_ctx.shape[1], -1, queries.shape[-1])
    ctx_scores = torch.einsum("bwcjd,bcld->bwcjl", q, keys_ctx) + ctx_bias[:, None, None, None]
    scores = torch.cat([ctx_scores, torch.einsum("bwcjd,bwcld->bwcjl", q, path_k)], -1)
    probs = _softmax(scores)
    num_ctx = keys_ctx.shape[2]
    attn = (torch.einsum("bwcjl,bcld->bwcjd", probs[..., :num_ctx], values_ctx)
            + torch.einsum("bwcjl,bwcld->bwcjd", probs[..., num_ctx:], path_v))
    return attn.flatten(2, 3)
