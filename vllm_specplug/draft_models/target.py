"""The frozen pieces of the target a draft head trains against.

Only the embedding, the final norm and the lm_head are read (safetensors slices
by name): the hidden states come from the extracted dataset.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_KEY = "model.embed_tokens.weight"
NORM_KEY = "model.norm.weight"
LM_HEAD_KEY = "lm_head.weight"


@dataclass
class TargetParts:
    config: dict
    embed_weight: torch.Tensor    # [V, H]
    norm_weight: torch.Tensor     # [H]
    lm_head_weight: torch.Tensor  # [V, H]
    rms_norm_eps: float

    @classmethod
    def load(cls, model_dir: str | Path) -> "TargetParts":
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config = config.get("text_config", config)
        tensors = _read(model_dir, {EMBED_KEY, NORM_KEY, LM_HEAD_KEY})
        if EMBED_KEY not in tensors or NORM_KEY not in tensors:
            raise ValueError(f"--target {model_dir}: {EMBED_KEY} / {NORM_KEY} not "
                             "found; a Llama-style checkpoint is expected")
        lm_head = tensors.get(LM_HEAD_KEY, tensors[EMBED_KEY])   # tied embeddings
        return cls(config, tensors[EMBED_KEY].float(), tensors[NORM_KEY].float(),
                   lm_head.float(), float(config.get("rms_norm_eps", 1e-6)))

    def to(self, device: torch.device) -> "TargetParts":
        """The parts on `device` (tensors already there are not copied)."""
        return TargetParts(self.config, self.embed_weight.to(device),
                           self.norm_weight.to(device), self.lm_head_weight.to(device),
                           self.rms_norm_eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_weight[ids]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: the pre-norm last-layer state (layer id n) -> normed."""
        h = hidden.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.rms_norm_eps) \
            * self.norm_weight

    def logits(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Target logits from pre-norm last-layer states; restricted to
        `token_ids` (e.g. the draft vocabulary) when given."""
        weight = self.lm_head_weight if token_ids is None else self.lm_head_weight[token_ids]
        # The target's distribution is the label: fp32 even where the head
        # trains under bf16 autocast.
        with torch.autocast(hidden.device.type, enabled=False):
            return self.final_norm(hidden) @ weight.T


def _read(model_dir: Path, names: set[str]) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in names & set(handle.keys()):
                found[name] = handle.get_tensor(name)
    return found
