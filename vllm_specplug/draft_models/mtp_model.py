"""A multi-token-prediction (MTP) layer in plain PyTorch, parameter for
parameter the layout vLLM's `mimo_mtp` loads (MiMo, arXiv 2505.07608;
`vllm/model_executor/models/mimo_mtp.py`).

The layer sees the target's last hidden state h_t (before the final norm)
and the embedding of the next token x_{t+1}, and predicts x_{t+2}:
    u = input_proj([hidden_layernorm(h_t); token_layernorm(embed(x_{t+1}))])
    y = final_layernorm(Qwen2 decoder block(u))    -> logits = lm_head(y)
(the embedding is zeroed at position 0, as vLLM does). The target's embedding
and lm_head are shared and frozen. Drafting K > 1 tokens reuses the layer on
its own output y as the next step's hidden state, which training unrolls
(TTT, `layers.ttt_attend`). Checkpoint names: `model.mtp_layers.{i}.` +
`token_layernorm`, `hidden_layernorm`, `input_proj`, `self_attn.{q,k,v,o}_proj`
(q/k/v with bias), `mlp.*`, `input_layernorm`, `post_attention_layernorm`,
`final_layernorm`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_specplug.draft_models.layers import (MLP, RMSNorm, init_draft_parameters,
                                           rope_cos_sin, rope_inv_freq, shift_rows,
                                           split_heads, ttt_attend)

CHECKPOINT_PREFIX = "model.mtp_layers.{index}."


@dataclass
class MtpConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_target(cls, hf: dict) -> "MtpConfig":
        """The layer's shape: the target's (a Qwen2/MiMo or Llama config.json)."""
        heads = int(hf["num_attention_heads"])
        rope = hf.get("rope_parameters") or {}
        return cls(hidden_size=int(hf["hidden_size"]),
                   intermediate_size=int(hf["intermediate_size"]),
                   num_attention_heads=heads,
                   num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
                   head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
                   vocab_size=int(hf["vocab_size"]),
                   rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))))


class MtpAttention(nn.Module):
    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class MtpLayer(nn.Module):
    def __init__(self, config: MtpConfig) -> None:
        super().__init__()
        c = config
        self.config = config
        self.token_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MtpAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.final_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(c.head_dim, c.rope_theta),
                             persistent=False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, 0.02) weights, zero biases, unit norms: the untrained layer."""
        init_draft_parameters(self, generator)

    def _block(self, u, cos, sin, caches, step, key_valid):
        attn = self.self_attn
        x = self.input_layernorm(u)
        q, k, v = split_heads(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.num_heads,
                              attn.num_kv_heads, attn.head_dim, cos, sin)
        caches.append((k, v))
        out = ttt_attend(q, caches, step, key_valid)
        B, _, T, _ = out.shape
        residual = attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)) + u
        return self.mlp(self.post_attention_layernorm(residual)) + residual

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                key_valid: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """TTT unroll. hidden [B, T, H] (row t: the target's h_t), embeds
        [B, T, H] (row t: embedding of token t+1), positions [T], key_valid
        [B, T] bool. Returns per step the normed output [B, T, H] (logits =
        the target's lm_head of it; row t predicts token t+2 at every step: the
        chain anchored at t - k, whose input token there is x_{t+1})."""
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        # vLLM zeroes the token embedding at position 0
        embeds = torch.where((positions == 0)[None, :, None], 0.0, embeds)
        tokens = self.token_layernorm(embeds)
        caches: list = []
        outputs = []
        for step in range(num_steps):
            u = self.input_proj(torch.cat([self.hidden_layernorm(hidden), tokens], dim=-1))
            y = self.final_layernorm(self._block(u, cos, sin, caches, step, key_valid))
            outputs.append(y)
            hidden = shift_rows(y, 1)   # row t continues the chain of row t-1
        return outputs

    def checkpoint_tensors(self, index: int = 0) -> dict[str, torch.Tensor]:
        """This layer's tensors under the names vLLM's mimo_mtp loads."""
        prefix = CHECKPOINT_PREFIX.format(index=index)
        return {prefix + name: tensor.detach().contiguous()
                for name, tensor in self.state_dict().items()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], index: int = 0) -> None:
        prefix = CHECKPOINT_PREFIX.format(index=index)
        self.load_state_dict({name[len(prefix):]: t for name, t in tensors.items()
                              if name.startswith(prefix)})
