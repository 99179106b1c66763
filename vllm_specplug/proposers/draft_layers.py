"""One-layer drafters as `HeadRuntime` (eagle3_head.py) runs them: an EAGLE-3
head or an MTP layer, behind the same five steps, so one tree-drafting
runtime serves both.

For R rows (positions or tree nodes), each with the token's embedding
[R, H], the drafter's input hidden state [R, H] and a rope position:
    q, k, v, base = qkv(embeds, hidden, positions)   # [R, nh, hd], [R, kvh, hd] x2, [R, H]
    out = finish(attention output [R, nh*hd], base)  # [R, H]: the next hidden
    logits(out) -> [R, V'];  to_target(argmax ids) -> target token ids
`input_hidden` turns what the target provides (EAGLE-3: its auxiliary layers
[T, L*H_t]; MTP: its last hidden state [T, H]) into the first hidden.

The math is the training modules' (draft_models/), written for inference:
q/k/v and gate/up run as one matmul each over fused weights, as vLLM's
`QKVParallelLinear` and `MergedColumnParallelLinear` do; the rotary
embedding turns q and k in one pass; keys and values keep the KV heads
only. A drafting step launches a few hundred small kernels at batch 1, so
every op saved is launch time saved on the GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_specplug.draft_models.eagle3_model import Eagle3Head
from vllm_specplug.draft_models.layers import RMSNorm, rope_cos_sin, rotate
from vllm_specplug.draft_models.mtp_model import MtpLayer


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The module's weights in `dtype`; buffers stay as they are (`Module.to`
    would also round the rotary `inv_freq` buffer, shifting every angle)."""
    with torch.no_grad():
        for param in module.parameters():
            param.data = param.data.to(dtype)
    return module


def fuse_linears(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum out, in] weight (and bias) for linears that read the same
    input. The linears' parameters become views of it: no second copy (an
    8B-shaped head's q/k/v and gate/up are 330 MB in bf16)."""
    weight = torch.cat([linear.weight.data for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    bias = torch.cat([linear.bias.data for linear in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("fuse_linears: some linears have a bias and some do not")
    start = 0
    for linear in linears:
        end = start + linear.weight.shape[0]
        linear.weight.data = weight[start:end]
        if bias is not None:
            linear.bias.data = bias[start:end]
        start = end
    return weight, bias


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """`RMSNorm.forward` as one op (fused on CUDA). Statistics in float32
    as there; the rounding of bf16 outputs may differ in the last bit."""
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.eps)


class _FusedAttentionMlp:
    """A Llama decoder layer's projections over fused weights: what the
    EAGLE-3 and MTP drafters share. `attn` has q/k/v/o_proj, `mlp`
    gate/up/down_proj."""

    def _fuse(self, attn: torch.nn.Module, mlp: torch.nn.Module,
              inv_freq: torch.Tensor) -> None:
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.qkv_weight, self.qkv_bias = fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up_weight, _ = fuse_linears(mlp.gate_proj, mlp.up_proj)
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj
        self.inv_freq = inv_freq

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [*] -> float32 cos, sin [*, hd] (a drafting pass takes
        every depth's at once)."""
        cos, sin = rope_cos_sin(positions.flatten(), self.inv_freq)
        return cos.view(*positions.shape, self.head_dim), sin.view(*positions.shape, self.head_dim)

    def _project(self, x: torch.Tensor, positions: torch.Tensor, rope=None):
        """x [R, D] -> q [R, nh, hd], k, v [R, kvh, hd], q and k roped (in
        float32, as the training modules, then rounded). rope: (cos, sin)
        [R, hd] of `positions`, when the caller has them."""
        rows, nh, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        cos, sin = self.rope(positions) if rope is None else rope
        qk = rotate(qkv[:, :(nh + kvh) * hd].view(rows, nh + kvh, hd), cos[:, None],
                    sin[:, None]).to(x.dtype)
        return qk[:, :nh], qk[:, nh:], qkv[:, (nh + kvh) * hd:].view(rows, kvh, hd)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Eagle3DraftLayer(_FusedAttentionMlp):
    """vLLM's `Eagle3LlamaForCausalLM` math (draft_models/eagle3_model.py)."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head.eval()
        self.dtype = head.fc.weight.dtype  # the activations' dtype too
        c = head.config
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.logits_size = c.draft_vocab_size  # the head's own vocabulary
        self._fuse(head.midlayer.self_attn, head.midlayer.mlp, head.inv_freq)

    def input_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.head.fc(target_hidden.to(self.dtype))

    def qkv(self, embeds, hidden, positions, rope=None):
        mid = self.head.midlayer
        x = torch.cat([rms_norm(embeds, mid.input_layernorm),
                       rms_norm(hidden, mid.hidden_norm)], dim=-1)
        return *self._project(x, positions, rope), hidden

    def finish(self, attn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        residual = self.o_proj(attn) + base
        return self._mlp(rms_norm(residual, self.head.midlayer.post_attention_layernorm)) \
            + residual

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.lm_head(rms_norm(out, self.head.norm))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.head.draft_to_target(draft_ids)


class MtpDraftLayer(_FusedAttentionMlp):
    """vLLM's `mimo_mtp` math (draft_models/mtp_model.py), with the target's lm_head."""

    def __init__(self, layer: MtpLayer, lm_head_weight: torch.Tensor) -> None:
        self.layer = layer.eval()
        self.dtype = layer.input_proj.weight.dtype
        self.lm_head_weight = lm_head_weight.to(self.dtype)   # [V, H], the target's
        c = layer.config
        self.hidden_size = c.hidden_size
        self.vocab_size = self.logits_size = c.vocab_size
        self._fuse(layer.self_attn, layer.mlp, layer.inv_freq)

    def input_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden.to(self.dtype)

    def qkv(self, embeds, hidden, positions, rope=None):
        layer = self.layer
        embeds = torch.where((positions == 0)[:, None], 0.0, embeds)   # as vLLM
        base = layer.input_proj(torch.cat([rms_norm(hidden, layer.hidden_layernorm),
                                           rms_norm(embeds, layer.token_layernorm)], dim=-1))
        return *self._project(rms_norm(base, layer.input_layernorm), positions, rope), base

    def finish(self, attn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        residual = self.o_proj(attn) + base
        return rms_norm(self._mlp(rms_norm(residual, layer.post_attention_layernorm))
                        + residual, layer.final_layernorm)

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

    def target_sources(self, hidden_states: torch.Tensor | None,
                       aux_hidden_states: list[torch.Tensor] | None) -> list | None:
        """The target's tensors the drafter reads, [T, *] each (EAGLE-3: its
        auxiliary layers; MTP: the last hidden state); None where the runner
        did not produce them."""
        if self.aux_layer_ids is None:
            return None if hidden_states is None else [hidden_states]
        return aux_hidden_states

    def target_hidden(self, hidden_states: torch.Tensor | None,
                      aux_hidden_states: list[torch.Tensor] | None,
                      rows: torch.Tensor | slice,
                      out: torch.Tensor | None = None) -> torch.Tensor | None:
        """[len(rows), *] what the drafter reads at the target's token `rows`,
        the sources concatenated (into `out` when given: a graph's input)."""
        sources = self.target_sources(hidden_states, aux_hidden_states)
        if sources is None:
            return None
        if isinstance(rows, slice):
            if len(sources) == 1 and out is None:
                return sources[0][rows]  # a view
            return torch.cat([h[rows] for h in sources], dim=-1, out=out)
        # joined first, then one gather: two launches, where a gather per
        # source and a join took four and twice the host time (every step)
        joined = sources[0] if len(sources) == 1 else torch.cat(sources, dim=-1)
        return torch.index_select(joined, 0, rows, out=out)
