"""Patch of `vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward`.

Why: draft-tree nodes must attend to their ancestors only, and FlashAttention
takes no per-token mask (vLLM's tree attention backend was removed in
vllm#42121). After its kernel ran, the rows of the step's non-chain trees are
rewritten by our tree-attention kernel (integration/cuda_tree_attention.py).
Nothing changes unless a tree method activated it in this process.
"""
from __future__ import annotations

from vllm_specplug.patches.attention_forward import followed_by
from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.v1.attention.backends.flash_attn"


def with_tree_attention(original):
    """`forward` of a CUDA backend impl, followed by tree attention."""
    from vllm_specplug.integration.cuda_tree_attention import after_backend_forward

    def hook(impl, layer, query, kv_cache, attn_metadata, output) -> None:
        after_backend_forward(impl, query, kv_cache, attn_metadata, output)

    return followed_by(original, hook)


def install() -> list[str]:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    patch_registry.apply(FlashAttentionImpl, "forward",
                         with_tree_attention(FlashAttentionImpl.forward),
                         reason="tree attention for specplug draft trees (CUDA)")
    return [f"patch:{MODULE}.FlashAttentionImpl.forward"]
