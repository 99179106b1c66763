"""Pieces the draft heads share (EAGLE-3 `eagle3_model.py`, MTP `mtp_model.py`):
RMSNorm, the SwiGLU MLP, neox rotary embedding, and the attention of
training-time test (TTT).

TTT (EAGLE-3, arXiv 2503.01840): step k re-runs the draft layer on its own
previous output. Row t of step k is the draft at position t for the chain
anchored at a = t - k; it attends to step-0 keys at positions <= a (what the
draft's KV cache holds after verification) and to the step-j keys of the same
chain (position a + j), exactly what vLLM's drafter sees when it reuses one
layer for K draft tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


INIT_STD = 0.02


def init_draft_parameters(module: nn.Module, generator: torch.Generator | None = None) -> None:
    """A draft head's starting point: unit norms, zero biases, Normal(0, 0.02)
    for every other weight (in `named_parameters` order: seeded, reproducible)."""
    for name, param in module.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, INIT_STD, generator=generator)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, rope_theta: float) -> torch.Tensor:
    return 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, head_dim]."""
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding (the halves rotate), as vLLM's Llama/Qwen2."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def shift_rows(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Row t takes row t - shift (zeros shifted in). x: [B, ..., T, D] on dim -2."""
    if shift == 0:
        return x
    pad = torch.zeros_like(x[..., :shift, :])
    return torch.cat([pad, x[..., :-shift, :]], dim=-2)


def split_heads(q, k, v, num_heads: int, num_kv_heads: int, head_dim: int, cos, sin):
    """[B, T, n*hd] projections -> rotated q [B, nh, T, hd], k, v with the
    key/value heads repeated to nh (grouped-query attention)."""
    B, T, _ = q.shape
    q = q.view(B, T, num_heads, head_dim).transpose(1, 2)
    k = k.view(B, T, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(B, T, num_kv_heads, head_dim).transpose(1, 2)
    repeat = num_heads // num_kv_heads
    k = k.repeat_interleave(repeat, dim=1)
    v = v.repeat_interleave(repeat, dim=1)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def ttt_attend(q: torch.Tensor, caches: list, step: int, key_valid: torch.Tensor
               ) -> torch.Tensor:
    """Step `step`'s attention over step-0 keys (causal, up to the anchor)
    and the diagonal keys of steps 1..step. q [B, nh, T, hd]; caches: per
    step (k, v) [B, nh, T, hd]; key_valid: [B, T] bool. Returns [B, nh, T, hd]."""
    scale = q.shape[-1] ** -0.5
    k0, v0 = caches[0]
    T = q.shape[-2]
    rows = torch.arange(T, device=q.device)
    allowed = (rows[None, :] <= rows[:, None] - step)[None, None] \
        & key_valid[:, None, None, :]
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]
    values = []
    for j in range(1, step + 1):
        kj, vj = (shift_rows(t, step - j) for t in caches[j])
        ok = (rows >= step - j)[None, None, :, None]
        scores.append(((q * kj).sum(-1, keepdim=True) * scale)
                      .masked_fill(~ok, float("-inf")))
        values.append(vj)
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :T] @ v0
    for j, vj in enumerate(values, start=1):
        out = out + probs[..., T + j - 1:T + j] * vj
    return out
