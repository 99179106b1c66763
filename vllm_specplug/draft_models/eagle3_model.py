"""EAGLE-3 draft head in plain PyTorch, parameter for parameter vLLM's layout.

EAGLE-3 (arXiv 2503.01840): the target's auxiliary hidden states (L layers,
concatenated, [T, L*H_t]) go through `fc` to H; one decoder layer takes
[input_layernorm(embed(token)); hidden_norm(hidden)] (2H) into attention, with
the un-normed hidden as residual; `norm` then `lm_head` over the draft
vocabulary give the logits, and the pre-norm output is the hidden state fed to
the next draft step. This mirrors vLLM's `Eagle3LlamaForCausalLM`
(`model_executor/models/llama_eagle3.py`), whose checkpoint names we write:
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d` (the embedding is the
target's, shared, not saved).

Training-time test (TTT), shared with the MTP layer: `layers.ttt_attend`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from vllm_specplug.files import save_safetensors_atomic, write_text_atomic
from vllm_specplug.draft_models.layers import (MLP, RMSNorm, init_draft_parameters,
                                           rope_cos_sin, rope_inv_freq, shift_rows,
                                           split_heads, ttt_attend)

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int              # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]     # eagle_aux_hidden_state_layer_ids
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    def to_hf(self) -> dict:
        """config.json as vLLM's eagle3 loader reads it."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_hidden_layers": 1, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "dtype": "float32", "specplug_head_config": asdict(self),
        }


class Attention(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim,
                                bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim,
                                bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim,
                                bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                bias=False)


class MidLayer(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)


class Eagle3Head(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        num_aux = len(config.aux_layer_ids)
        self.fc = nn.Linear(num_aux * config.target_hidden_size, config.hidden_size,
                            bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta),
                             persistent=False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, 0.02) linears, unit norms: the 'untrained head'."""
        init_draft_parameters(self, generator)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq)

    def _qkv(self, embeds, hidden, cos, sin):
        """Layer input -> (q [B,nh,T,hd], k, v [B,nh,T,hd])."""
        attn = self.midlayer.self_attn
        x = torch.cat([self.midlayer.input_layernorm(embeds),
                       self.midlayer.hidden_norm(hidden)], dim=-1)
        return split_heads(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.num_heads,
                           attn.num_kv_heads, attn.head_dim, cos, sin)

    def _layer(self, embeds, hidden, cos, sin, caches, step, key_valid):
        q, k, v = self._qkv(embeds, hidden, cos, sin)
        caches.append((k, v))
        attn = ttt_attend(q, caches, step, key_valid)
        B, _, T, _ = attn.shape
        attn = self.midlayer.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        residual = attn + hidden
        mlp_out = self.midlayer.mlp(self.midlayer.post_attention_layernorm(residual))
        return mlp_out + residual       # pre-norm output: the next step's hidden

    def forward(self, aux_hidden: torch.Tensor, embeds: torch.Tensor,
                positions: torch.Tensor, key_valid: torch.Tensor,
                num_steps: int) -> list[torch.Tensor]:
        """TTT unroll. aux_hidden [B, T, L*H_t], embeds [B, T, H] (row t: embedding
        of token t+1), positions [T], key_valid [B, T] bool.
        Returns per step the draft logits [B, T, draft_vocab_size]."""
        cos, sin = self.rope(positions)
        hidden = self.fc(aux_hidden)
        caches: list = []
        logits = []
        for step in range(num_steps):
            out = self._layer(embeds, hidden, cos, sin, caches, step, key_valid)
            logits.append(self.lm_head(self.norm(out)))
            hidden = shift_rows(out, 1)   # row t continues the chain of row t-1
        return logits

    def save_pretrained(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        save_safetensors_atomic(self.state_dict(), out / "model.safetensors")
        write_text_atomic(json.dumps(self.config.to_hf(), indent=2), out / "config.json")

    @classmethod
    def from_pretrained(cls, head_dir: str | Path) -> "Eagle3Head":
        """A head written by `save_pretrained`; HeadLoadError names what is wrong."""
        head = cls(_read_head_config(Path(head_dir)))
        path = Path(head_dir) / "model.safetensors"
        tensors = load_tensors(path, HeadLoadError, HEAD_FIX)
        problems = tensor_problems(head, tensors)
        if problems:
            raise HeadLoadError(f"{path}: {'; '.join(problems)}; {HEAD_FIX}")
        head.load_state_dict(tensors)
        return head


class HeadLoadError(ValueError):
    """A head directory whose config.json or tensors do not make our head."""


HEAD_FIX = ("a head directory holds config.json and model.safetensors as "
            "`vllm-specplug train-eagle3` writes them, from one run: re-run it with "
            "the same --out to write them again (it resumes from OUT/checkpoints)")


def _read_head_config(head_dir: Path) -> HeadConfig:
    path = head_dir / "config.json"
    try:
        hf = json.loads(path.read_text())
        return HeadConfig(**hf["specplug_head_config"])
    except FileNotFoundError:
        raise HeadLoadError(f"{path}: missing; {HEAD_FIX}") from None
    except (KeyError, TypeError) as error:
        raise HeadLoadError(f"{path}: no usable specplug_head_config ({error}): not "
                            f"written by vllm-specplug (vLLM's eagle3 loads other "
                            f"heads itself); {HEAD_FIX}") from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeadLoadError(f"{path}: unreadable ({error}); {HEAD_FIX}") from error


def load_tensors(path: Path, error_class: type, fix: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; `error_class` naming the file and `fix`."""
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise error_class(f"{path}: missing; {fix}") from None
    except (OSError, SafetensorError) as error:
        raise error_class(f"{path}: not a readable safetensors file ({error}): cut "
                          f"short or overwritten; {fix}") from error


def tensor_problems(module: nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Missing, unexpected and mis-shaped (or mis-typed) tensor names, against
    `module`'s state dict; empty when `tensors` load exactly."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{name} {list(tensors[name].shape)} {tensors[name].dtype} (expected "
             f"{list(want.shape)} {want.dtype})" for name, want in expected.items()
             if name in tensors and (tensors[name].shape != want.shape
                                     or tensors[name].dtype != want.dtype)]
    return [f"{label} tensors: {', '.join(names)}" for label, names in
            (("missing", missing), ("unexpected", unexpected), ("mis-shaped", wrong))
            if names]
