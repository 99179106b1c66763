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
        if plain and split_forward(self, query, kv_cache, attn_metadata, output):
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
