"""Patch of `vllm.v1.attention.backends.triton_attn.TritonAttentionImpl.forward`
(the CUDA backend vLLM picks for float32 models): tree attention after its
kernel, as for FlashAttention (patches/flash_attn.py says why)."""
from __future__ import annotations

from vllm_specplug.patches.flash_attn import with_tree_attention
from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.v1.attention.backends.triton_attn"


def install() -> list[str]:
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    patch_registry.apply(TritonAttentionImpl, "forward",
                         with_tree_attention(TritonAttentionImpl.forward),
                         reason="tree attention for specplug draft trees (CUDA)")
    return [f"patch:{MODULE}.TritonAttentionImpl.forward"]
