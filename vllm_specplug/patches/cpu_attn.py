"""Patch of `vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`.

Why: a draft tree's nodes must attend to their ancestors only, and no vLLM
0.32 backend takes an arbitrary per-token mask (its tree attention was
removed in vllm#42121; `dynamic_causal` is per sequence). Registering a whole
CUSTOM backend would fork the CPU kernel; instead, after the kernel ran, the
rows of this step's non-chain trees are recomputed (integration/
tree_attention.py). Steps without trees run vLLM's code alone.
"""
from __future__ import annotations

from vllm_specplug.patches.attention_forward import followed_by
from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.v1.attention.backends.cpu_attn"


def _tree_rows(impl, layer, query, kv_cache, attn_metadata, output) -> None:
    from vllm.v1.attention.backend import AttentionType

    from vllm_specplug.integration.v1.cpu_kv_layout import layout_of
    from vllm_specplug.integration.v1.cpu_tree_attention import apply_tree_attention, current_step

    step = current_step(impl)
    if (step is not None and step.masked() and attn_metadata is not None
            and impl.attn_type == AttentionType.DECODER):
        apply_tree_attention(impl, query, kv_cache, layout_of(kv_cache, layer.isa),
                             attn_metadata.block_table, output, step)


def install() -> list[str]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    patch_registry.apply(CPUAttentionBackendImpl, "forward",
                         followed_by(CPUAttentionBackendImpl.forward, _tree_rows),
                         reason="tree attention for specplug_eagle3 draft trees")
    return [f"patch:{MODULE}.CPUAttentionBackendImpl.forward"]
