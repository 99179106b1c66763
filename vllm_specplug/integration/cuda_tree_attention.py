"""Tree attention on vLLM's CUDA attention backends (FlashAttention and
Triton; FlexAttention is not wrapped), and KV compaction in their cache layout.

The backend's kernel runs first (it writes every token's K/V at its
sequential slot and attends causally); then our kernel (`kernels/
tree_attention.py`) rewrites the rows of this step's non-chain trees. Its
inputs live in persistent buffers (the V1 runner's `v1/cuda_tree_buffers.py`,
written from the host layout; Model Runner V2's `v2/tree_slots.py`, written
on the device), filled once per step, so the launch can be captured in a
FULL CUDA graph:
at replay the kernel reads the step's trees from the same addresses (each
attention layer's impl holds the buffers: `attach`), and
rows without a tree (chains, requests without drafts, batch padding) have
`num_nodes = 0`, which the kernel skips.

On FlashAttention 3 layers, a step whose queries fit a tree (at most its
node count per request: every decode step, captured or not) takes the split
way instead (`split_forward`, option `tree_attention="split"`): FlashAttention
attends every row to its request's prefix only and returns its log-sum-exp,
then `verification/tree_attention_split.tree_part_attention` attends each row
to this step's tokens under its tree mask (causally for the rest) and merges
the two. The cache is read once, where the first way reads a tree request's
cache twice.

Every vLLM 0.32 CUDA backend gives a layer's cache in one logical order,
[num_blocks, num_kv_heads, block_size, 2 * head_size], and splits it with
`kv_cache.transpose(1, 2).split(head_size, -1)`; we read it the same way.
"""
from __future__ import annotations

import os

import torch

from vllm_specplug.verification.tree_attention import (KEY_SPLIT_CHOICES, num_key_splits,
                                                       tree_attention_triton)
from vllm_specplug.verification.tree_attention_split import (prefix_lens_of,
                                                             tree_part_attention_triton)

NO_WINDOW = (None, -1, (-1, -1))  # how the CPU and CUDA backends say "no sliding window"


class TreeAttentionUnsupported(RuntimeError):
    """A layer feature tree attention does not implement."""


def check_supported(impl) -> None:
    problems = [name for name, bad in (
        ("logits soft cap", bool(getattr(impl, "logits_soft_cap", 0))),
        ("sliding window", getattr(impl, "sliding_window", None) not in NO_WINDOW),
        ("ALiBi", getattr(impl, "alibi_slopes", None) is not None),
        ("attention sinks", getattr(impl, "sinks", None) is not None),
        ("quantized KV cache", getattr(impl, "kv_cache_dtype", "auto") != "auto"))
        if bad]
    if problems:
        raise TreeAttentionUnsupported(
            f"specplug_eagle3 trees (topk > 1) do not support {', '.join(problems)} "
            "yet; use topk=1 (a chain needs no tree attention)")



DECODER = "decoder"  # vLLM's AttentionType.DECODER: self-attention over the request's tokens
TREE_ROWS_ATTR = "specplug_tree_rows"  # set on each attention impl by `attach`


def attach(layers: dict, buffers) -> int:
    """Tree attention in these attention layers (vLLM's static forward
    context: name -> layer): each layer's impl reads `buffers` (a
    `TreeAttentionBuffers`, or Model Runner V2's `TreeSlots`); None turns it
    off. Returns how many layers were attached."""
    count = 0
    for layer in layers.values():
        impl = getattr(layer, "impl", None)
        if impl is not None:
            setattr(impl, TREE_ROWS_ATTR, buffers)
            count += 1
    return count


def attached(layers: dict):
    """The buffers the first attention layer reads (None: tree attention off)."""
    impl = next((getattr(m, "impl") for m in layers.values() if hasattr(m, "impl")), None)
    return getattr(impl, TREE_ROWS_ATTR, None)


def after_backend_forward(impl, query, kv_cache, attn_metadata, output) -> None:
    """Called after a CUDA backend's `forward`: tree rows get tree attention.
    Launched during CUDA-graph capture even with no tree (the graph must
    contain the launch for the steps it will replay), unless no request of
    the step has more than one query token (`one_token_queries`)."""
    buffers = getattr(impl, TREE_ROWS_ATTR, None)
    if (buffers is None or attn_metadata is None or kv_cache is None
            or getattr(impl, "attn_type", DECODER) != DECODER):
        return
    # The first launch per layer shape compiles the kernel: let it happen in
    # vLLM's warm-up runs, never inside a stream capture.
    key = (query.dtype, kv_cache.dtype, impl.num_heads, impl.num_kv_heads, impl.head_size,
           kv_cache.shape[2])
    first = key not in buffers.compiled
    capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
    idle = buffers.num_masked == 0 and not capturing
    if not first and (idle or one_token_queries(attn_metadata)):
        return
    buffers.compiled.add(key)
    check_supported(impl)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    num_reqs = min(attn_metadata.block_table.shape[0], buffers.max_num_reqs)
    # a capture may pick any key-split count (it follows the batch size):
    # compile them all now, outside any capture (each launch writes the same rows)
    for num_splits in (KEY_SPLIT_CHOICES if first and not capturing else (None,)):
        tree_attention_triton(query.view(-1, impl.num_heads, impl.head_size), key_cache,
                              value_cache, attn_metadata.block_table, buffers.metadata,
                              impl.scale, output.view(-1, impl.num_heads, impl.head_size),
                              num_requests=num_reqs, num_splits=num_splits,
                              precision=backend_dot_precision(impl, query.dtype))


def backend_dot_precision(impl, dtype: torch.dtype) -> str | None:
    """The input precision of the backend's own `tl.dot`, for our kernel to
    compute the tree rows as the backend computes every other row. vLLM's
    Triton attention (`triton_unified_attention.py`, the backend of float32
    targets) leaves it at Triton's default, TF32 for float32 on CUDA unless
    TRITON_F32_DEFAULT says otherwise. Without speculation each token comes
    from that kernel; our rows in IEEE float32 differ from it by TF32's
    rounding (about 1e-3 relative). The likely cause, not yet confirmed on a
    GPU, of the 2 outputs in 128 at batch 64 that differed from no
    speculation's beyond a near-tie on the H100, for static and adaptive
    trees alike, while vLLM's eagle3, verified by vLLM's kernel, was exact
    (docs/results/batch_draft_length_h100_run2). None: our default."""
    if dtype == torch.float32 and any(cls.__name__ == "TritonAttentionImpl"
                                      for cls in type(impl).__mro__):
        return os.environ.get("TRITON_F32_DEFAULT", "tf32")
    return None


PREFIX_LENS_ATTR = "specplug_prefix_lens"  # set on a step's attention metadata, once


def one_token_queries(attn_metadata) -> bool:
    """No request has more than one query token this step: no draft, so no
    tree node (a step at draft length 0 under the batch policy, or a decode
    of requests that drafted nothing). The backend's own attention is then
    the whole answer, as without speculation; our kernels would launch for
    nothing (on the H200 a step at length 0 took 2.63 ms on SmolLM2 where
    no speculation's took 2.05, docs/results/batch_draft_length_h200_run14).
    A host value: the same at capture and at every replay of a graph."""
    most = getattr(attn_metadata, "max_query_len", None)
    return isinstance(most, int) and most <= 1


def split_applies(impl, attn_metadata, buffers) -> bool:
    """The split way serves this layer and step: FlashAttention 3 without
    the features it would have to pass on, and between two and a tree's
    node count of query tokens per request (host values only: the same
    answer at capture and at every replay of a graph)."""
    return (buffers is not None and getattr(buffers, "split_attention", False)
            and attn_metadata is not None and not one_token_queries(attn_metadata)
            and getattr(impl, "attn_type", DECODER) == DECODER
            and getattr(impl, "vllm_flash_attn_version", None) == 3
            and getattr(impl, "dcp_world_size", 1) == 1
            and getattr(attn_metadata, "causal", True) is True
            and getattr(attn_metadata, "mm_prefix_query_range_tensor", None) is None
            and getattr(attn_metadata, "rswa_prefix_lens", None) is None
            and attn_metadata.max_query_len <= buffers.metadata.max_nodes)


def split_forward(impl, query, kv_cache, attn_metadata, output, prefix_attention) -> bool:
    """FlashAttention's `forward` the split way, when it applies (returns
    whether it ran). The K/V of this step are already in the cache (vLLM
    writes them in `do_kv_cache_update`, before `forward`).
    `prefix_attention(impl, query, key_cache, value_cache, attn_metadata,
    prefix_lens, out) -> lse`: vLLM's FlashAttention over each request's
    first `prefix_lens` keys, unmasked, writing `out` and returning the
    log-sum-exp [num_heads, T] (`patches/flash_attn.flash_prefix_attention`;
    a plain-PyTorch stand-in in the CPU tests)."""
    buffers = getattr(impl, TREE_ROWS_ATTR, None)
    if not split_applies(impl, attn_metadata, buffers):
        return False
    check_supported(impl)
    buffers.split_layers += 1
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    prefix_lens = getattr(attn_metadata, PREFIX_LENS_ATTR, None)
    if prefix_lens is None:  # the first layer of the step (or of a capture)
        prefix_lens = prefix_lens_of(attn_metadata.query_start_loc, attn_metadata.seq_lens)
        setattr(attn_metadata, PREFIX_LENS_ATTR, prefix_lens)
    num_tokens = attn_metadata.num_actual_tokens
    query = query[:num_tokens].view(-1, impl.num_heads, impl.head_size)
    out = output[:num_tokens].view(-1, impl.num_heads, impl.head_size)
    lse = prefix_attention(impl, query, key_cache, value_cache, attn_metadata, prefix_lens, out)
    if lse.shape[0] != impl.num_heads:  # [T, H] -> [H, T]
        lse = lse.transpose(0, 1)
    tree_part_attention_triton(query, key_cache, value_cache, attn_metadata.block_table,
                               attn_metadata.query_start_loc, attn_metadata.seq_lens,
                               buffers.metadata.num_nodes, buffers.metadata.ancestor_bits,
                               impl.scale, out, lse, max_query_len=attn_metadata.max_query_len)
    return True


def prefix_num_splits(num_reqs: int, num_kv_heads: int, max_num_splits: int, device) -> int:
    """Key splits for the prefix call: none once the batch's (request, KV
    head) pairs fill a quarter of the SMs, up to 16 below (as our rewrite
    kernel splits, `num_key_splits`), never above vLLM's bound for CUDA
    graphs. vLLM's own call takes its bound (32 by default) with scheduler
    metadata that trims it per step; ours has none, and 32 splits of a
    short prefix at batch 64 would be 32 partial rows and a combine."""
    splits = num_key_splits(num_reqs * num_kv_heads, device)
    return splits if max_num_splits <= 0 else min(splits, max_num_splits)


def move_cached_tokens(kv_cache: torch.Tensor, src_slots: torch.Tensor,
                       dst_slots: torch.Tensor) -> None:
    """KV compaction in the CUDA backends' layout: the K/V of the tokens at
    `src_slots` [S] move to `dst_slots` [S] (all read before any write)."""
    by_slot = kv_cache.transpose(1, 2)  # [num_blocks, block_size, kv_heads, 2 * head_size]
    block_size = by_slot.shape[1]
    rows = by_slot[src_slots // block_size, src_slots % block_size]
    by_slot[dst_slots // block_size, dst_slots % block_size] = rows
