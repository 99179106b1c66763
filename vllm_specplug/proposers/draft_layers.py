"""One-layer drafters as `HeadRuntime` (eagle3_head.py) runs them: an EAGLE-3
head or an MTP layer, behind the same five steps, so one tree-drafting
runtime serves both.

For R rows (positions or tree nodes), each with the token's embedding
[R, H], the drafter's input hidden state [R, H] and a rope position:
    q, k, v, base = qkv(embeds, hidden, positions)   # [R, nh, hd] x3, [R, H]
    out = finish(attention output [R, nh*hd], base)  # [R, H]: the next hidden
    logits(out) -> [R, V'];  to_target(argmax ids) -> target token ids
`input_hidden` turns what the target provides (EAGLE-3: its auxiliary layers
[T, L*H_t]; MTP: its last hidden state [T, H]) into the first hidden.
"""
from __future__ import annotations

import torch

from vllm_specplug.draft_models.eagle3_model import Eagle3Head
from vllm_specplug.draft_models.layers import rope_cos_sin, split_heads
from vllm_specplug.draft_models.mtp_model import MtpLayer


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The module's weights in `dtype`; buffers stay as they are (`Module.to`
    would also round the rotary `inv_freq` buffer, shifting every angle)."""
    with torch.no_grad():
        for param in module.parameters():
            param.data = param.data.to(dtype)
    return module


class Eagle3DraftLayer:
    """vLLM's `Eagle3LlamaForCausalLM` math (draft_models/eagle3_model.py)."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head.eval()
        self.dtype = head.fc.weight.dtype  # the activations' dtype too
        c = head.config
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim, self.hidden_size = c.head_dim, c.hidden_size
        self.vocab_size = c.vocab_size
        self.logits_size = c.draft_vocab_size  # the head's own vocabulary

    def input_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.head.fc(target_hidden.to(self.dtype))

    def qkv(self, embeds, hidden, positions):
        cos, sin = self.head.rope(positions)
        q, k, v = self.head._qkv(embeds[:, None], hidden[:, None], cos[:, None, None],
                                 sin[:, None, None])
        return q[:, :, 0], k[:, :, 0], v[:, :, 0], hidden

    def finish(self, attn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        mid = self.head.midlayer
        residual = mid.self_attn.o_proj(attn) + base
        return mid.mlp(mid.post_attention_layernorm(residual)) + residual

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.lm_head(self.head.norm(out))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.head.draft_to_target(draft_ids)


class MtpDraftLayer:
    """vLLM's `mimo_mtp` math (draft_models/mtp_model.py), with the target's lm_head."""

    def __init__(self, layer: MtpLayer, lm_head_weight: torch.Tensor) -> None:
        self.layer = layer.eval()
        self.dtype = layer.input_proj.weight.dtype
        self.lm_head_weight = lm_head_weight.to(self.dtype)   # [V, H], the target's
        c = layer.config
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim, self.hidden_size = c.head_dim, c.hidden_size
        self.vocab_size = self.logits_size = c.vocab_size

    def input_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden.to(self.dtype)

    def qkv(self, embeds, hidden, positions):
        layer, attn = self.layer, self.layer.self_attn
        embeds = torch.where((positions == 0)[:, None], 0.0, embeds)   # as vLLM
        base = layer.input_proj(torch.cat([layer.hidden_layernorm(hidden),
                                           layer.token_layernorm(embeds)], dim=-1))
        x = layer.input_layernorm(base)[:, None]                        # [R, 1, H]
        cos, sin = rope_cos_sin(positions, layer.inv_freq)
        q, k, v = split_heads(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.num_heads,
                              attn.num_kv_heads, attn.head_dim, cos[:, None, None],
                              sin[:, None, None])
        return q[:, :, 0], k[:, :, 0], v[:, :, 0], base

    def finish(self, attn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        residual = layer.self_attn.o_proj(attn) + base
        return layer.final_layernorm(layer.mlp(layer.post_attention_layernorm(residual))
                                     + residual)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return out @ self.lm_head_weight.T

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


def as_draft_layer(head) -> Eagle3DraftLayer | MtpDraftLayer:
    return Eagle3DraftLayer(head) if isinstance(head, Eagle3Head) else head


class LoadedDrafter:
    """A tree method's one-layer drafter, read from disk on the host before
    the target exists: what both runners' drafters share. `build` puts it on
    the device in the drafter's dtype, with the target's modules it borrows."""

    def __init__(self, description: str, aux_layer_ids: tuple[int, ...] | None,
                 module: torch.nn.Module, lm_head_weight: torch.Tensor | None = None):
        self.description = description
        # target layers whose hidden states it reads (None: the last hidden state)
        self.aux_layer_ids = aux_layer_ids
        self.module = module
        self.lm_head_weight = lm_head_weight  # MTP: the target's [V, H]

    def build(self, device: torch.device, dtype: torch.dtype):
        """An `Eagle3Head` or an `MtpDraftLayer` on `device`, weights in `dtype`."""
        module = cast_parameters(self.module.to(device), dtype)
        if self.lm_head_weight is None:
            return module
        return MtpDraftLayer(module, self.lm_head_weight.to(device))

    def target_hidden(self, hidden_states: torch.Tensor | None,
                      aux_hidden_states: list[torch.Tensor] | None,
                      rows: torch.Tensor | slice) -> torch.Tensor | None:
        """[len(rows), *] what the drafter reads at the target's token `rows`
        (EAGLE-3: its auxiliary layers, concatenated; MTP: the last hidden
        state); None where the runner did not produce it."""
        if self.aux_layer_ids is None:
            return None if hidden_states is None else hidden_states[rows]
        if aux_hidden_states is None:
            return None
        return torch.cat([h[rows] for h in aux_hidden_states], dim=-1)
