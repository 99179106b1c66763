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
Math in float32; GQA by repeating K/V heads. All masked requests of a step
run as one padded batch per layer (`TreeRows`, built once a step).
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class TreeRows:
    """The masked requests of one step as one padded batch (R requests, up to
    N nodes, up to L key positions), built once per step and block table and
    read by every layer."""
    query_rows: torch.Tensor  # [R, N] int64, each node's token row (padding: the root's)
    slots: torch.Tensor  # [R, L] int64, cache slot of each key position (padding: 0)
    allowed: torch.Tensor  # [R, N, L] bool, prefix + the node's root path
    is_node: torch.Tensor  # [R, N] bool, False on padding rows


def tree_rows(masked: list[TreeRequest], block_table: torch.Tensor,
              block_size: int) -> TreeRows:
    num_nodes = max(r.num_nodes for r in masked)
    num_keys = max(r.seq_len + r.num_nodes for r in masked)
    query_rows = torch.zeros(len(masked), num_nodes, dtype=torch.long)
    slots = torch.zeros(len(masked), num_keys, dtype=torch.long)
    allowed = torch.zeros(len(masked), num_nodes, num_keys, dtype=torch.bool)
    is_node = torch.zeros(len(masked), num_nodes, dtype=torch.bool)
    for i, request in enumerate(masked):
        n, seq_len = request.num_nodes, request.seq_len
        query_rows[i] = request.first_token
        query_rows[i, :n] += torch.arange(n)
        slots[i, :seq_len + n] = request_slots(block_table[request.row].cpu(), seq_len + n,
                                               block_size)
        allowed[i, :n, :seq_len] = True
        allowed[i, :n, seq_len:seq_len + n] = request.ancestor_mask()
        is_node[i, :n] = True
    return TreeRows(query_rows, slots, allowed, is_node)


def _batch_attention(impl, query, kv_cache, layout: BlockLayout, rows: TreeRows
                     ) -> torch.Tensor:
    """[R, N, num_heads, head_size] outputs of the masked requests' nodes
    (padding rows and keys are masked out: they add exact zeros)."""
    batch, num_keys = rows.slots.shape
    keys, values = layout.read(kv_cache, rows.slots.flatten().to(query.device))
    repeat = impl.num_heads // impl.num_kv_heads
    keys = keys.float().view(batch, num_keys, impl.num_kv_heads, -1)
    values = values.float().view(batch, num_keys, impl.num_kv_heads, -1)
    keys = keys.repeat_interleave(repeat, dim=2)
    values = values.repeat_interleave(repeat, dim=2)
    q = query[rows.query_rows.to(query.device)].float()  # [R, N, h, d]
    scores = torch.einsum("rnhd,rlhd->rhnl", q, keys) * impl.scale
    allowed = rows.allowed.to(query.device)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("rhnl,rlhd->rnhd", probs, values)


def apply_tree_attention(impl, query: torch.Tensor, kv_cache: torch.Tensor,
                         layout: BlockLayout, block_table: torch.Tensor,
                         output: torch.Tensor, step: TreeStep) -> None:
    """Overwrite `output` rows of non-chain trees with tree attention."""
    masked = step.masked()
    if not masked:
        return
    check_supported(impl)
    key = (block_table.data_ptr(), layout.block_size)
    if step.cpu_rows is None or step.cpu_rows[0] != key:  # once a step, not once a layer
        step.cpu_rows = (key, tree_rows(masked, block_table, layout.block_size))
    rows = step.cpu_rows[1]
    out = output.view(-1, impl.num_heads, impl.head_size)
    attended = _batch_attention(impl, query, kv_cache, layout, rows)
    is_node = rows.is_node.to(out.device)
    out[rows.query_rows.to(out.device)[is_node]] = attended[is_node].to(out.dtype)
