"""Tree attention for the drafted nodes of a step (vLLM removed its own in
vllm#42121).

The backend's kernel has already written every token's K/V into the paged
cache and attended causally. For requests whose tree is not a chain, the
rows of their nodes are recomputed here: node i attends to the prefix
(positions < seq_len) and to the nodes on its root path, which sit at slot
positions seq_len + j (tree_step.py). Chains are left to the kernel: causal
attention is the tree mask there, bit for bit.

Tokens are read through a `BlockLayout` (where the backend's kernel keeps a
token's K/V inside a block: probed for vLLM's CPU kernel, cpu_kv_layout.py).
Math in float32; GQA by repeating K/V heads.
"""
from __future__ import annotations

import torch

from vllm_specplug.integration.cuda_tree_attention import check_supported
from vllm_specplug.integration.v1.cpu_kv_layout import BlockLayout
from vllm_specplug.integration.v1.tree_step import TreeRequest, TreeStep


STEP_SOURCE_ATTR = "specplug_tree_step_source"  # set on each attention impl


def attach_step_source(layers: dict, source) -> None:
    """The attention layers (vLLM's static forward context) read this step's
    tree layout from `source.current_step` (the tree drafter)."""
    for layer in layers.values():
        impl = getattr(layer, "impl", None)
        if impl is not None:
            setattr(impl, STEP_SOURCE_ATTR, source)


def current_step(impl) -> TreeStep | None:
    source = getattr(impl, STEP_SOURCE_ATTR, None)
    return None if source is None else source.current_step


def request_slots(block_ids: torch.Tensor, num_positions: int, block_size: int):
    positions = torch.arange(num_positions, device=block_ids.device)
    return block_ids[positions // block_size].long() * block_size + positions % block_size


def _request_attention(impl, query, kv_cache, layout: BlockLayout, block_ids,
                       request: TreeRequest) -> torch.Tensor:
    """[N, num_heads, head_size] outputs of one request's nodes."""
    num_nodes, seq_len = request.num_nodes, request.seq_len
    slots = request_slots(block_ids, seq_len + num_nodes, layout.block_size)
    keys, values = layout.read(kv_cache, slots)
    repeat = impl.num_heads // impl.num_kv_heads
    keys = keys.float().repeat_interleave(repeat, dim=1)
    values = values.float().repeat_interleave(repeat, dim=1)
    allowed = torch.cat([torch.ones(num_nodes, seq_len, dtype=torch.bool),
                         request.ancestor_mask()], dim=1).to(query.device)
    q = query[request.first_token:request.first_token + num_nodes].float()
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * impl.scale
    probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, values)


def apply_tree_attention(impl, query: torch.Tensor, kv_cache: torch.Tensor,
                         layout: BlockLayout, block_table: torch.Tensor,
                         output: torch.Tensor, step: TreeStep) -> None:
    """Overwrite `output` rows of non-chain trees with tree attention."""
    masked = step.masked()
    if not masked:
        return
    check_supported(impl)
    out = output.view(-1, impl.num_heads, impl.head_size)
    for request in masked:
        rows = slice(request.first_token, request.first_token + request.num_nodes)
        out[rows] = _request_attention(impl, query, kv_cache, layout,
                                       block_table[request.row], request).to(out.dtype)
