"""Patch of `vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward`.

Why: draft-tree nodes must attend to their ancestors only, and FlashAttention
takes no per-token mask (vLLM's tree attention backend was removed in
vllm#42121). On FlashAttention 3, a step whose queries fit the tree runs
split: FlashAttention over each request's prefix, our kernel over the
step's tokens, merged (`split_forward`). Otherwise the backend's forward
runs, and the rows of the step's non-chain trees are rewritten by our
tree-attention kernel (integration/cuda_tree_attention.py). Nothing changes
unless a tree method activated it in this process.
"""
from __future__ import annotations

from vllm_specplug.patches.attention_forward import followed_by
from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.v1.attention.backends.flash_attn"


def flash_prefix_attention(impl, query, key_cache, value_cache, attn_metadata, prefix_lens,
                           out):
    """vLLM's FlashAttention 3 over each request's first `prefix_lens` keys,
    unmasked, as its context-parallel path calls it; returns the
    log-sum-exp [num_heads, T]. No scheduler metadata: vLLM's was computed
    for the causal call over all keys. The split way's prefix part
    (`integration/cuda_tree_attention.split_forward`)."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    from vllm_specplug.integration.cuda_tree_attention import prefix_num_splits

    _, lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=out,
        cu_seqlens_q=attn_metadata.query_start_loc, max_seqlen_q=attn_metadata.max_query_len,
        seqused_k=prefix_lens, max_seqlen_k=attn_metadata.max_seq_len,
        softmax_scale=impl.scale, causal=False, block_table=attn_metadata.block_table,
        return_softmax_lse=True, fa_version=3,
        num_splits=prefix_num_splits(prefix_lens.shape[0], impl.num_kv_heads,
                                     attn_metadata.max_num_splits, query.device))
    return lse


def with_tree_attention(original):
    """`forward` of FlashAttentionImpl: the split way where it applies,
    else the backend's forward followed by tree attention."""
    from vllm_specplug.integration.cuda_tree_attention import (after_backend_forward,
                                                               split_forward)

    def hook(impl, layer, query, kv_cache, attn_metadata, output) -> None:
        after_backend_forward(impl, query, kv_cache, attn_metadata, output)

    rewrite = followed_by(original, hook)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                *args, **kwargs):
        plain = not args and all(extra is None for extra in kwargs.values())
        if plain and split_forward(self, query, kv_cache, attn_metadata, output,
                                   flash_prefix_attention):
            return output
        return rewrite(self, layer, query, key, value, kv_cache, attn_metadata, output,
                       *args, **kwargs)

    return forward


def install() -> list[str]:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    patch_registry.apply(FlashAttentionImpl, "forward",
                         with_tree_attention(FlashAttentionImpl.forward),
                         reason="tree attention for specplug draft trees (CUDA)")
    return [f"patch:{MODULE}.FlashAttentionImpl.forward"]
