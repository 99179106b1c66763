"""Padded training batches from dataset samples, and the train/held-out split."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch

from vllm_specplug.draft_models.target import TargetParts


@dataclass
class Batch:
    aux_hidden: torch.Tensor   # [B, T, L*H] float32, target auxiliary layers
    embeds: torch.Tensor       # [B, T, H] float32, row t: embedding of token t+1
    positions: torch.Tensor    # [T] int64
    key_valid: torch.Tensor    # [B, T] bool, rows that have a next token
    target_last: torch.Tensor  # [B, T, H] float32, row t: last layer at t+1
    loss_rows: torch.Tensor    # [B, T] bool, row t predicts a response token (t+2)

    def to(self, device: torch.device) -> "Batch":
        """The same batch on `device` (tensors already there are not copied)."""
        return Batch(*(getattr(self, f.name).to(device, non_blocking=True)
                       for f in dataclasses.fields(self)))


def split_ids(sample_ids: list[str], held_out_fraction: float) -> tuple[list, list]:
    """Stable split by a hash of the sample id; at least one of each when possible."""
    def bucket(sample_id: str) -> float:
        return int(hashlib.sha1(sample_id.encode()).hexdigest()[:8], 16) / 16 ** 8

    held_out = [s for s in sample_ids if bucket(s) < held_out_fraction]
    if not held_out and held_out_fraction > 0 and len(sample_ids) > 1:
        held_out = [min(sample_ids, key=bucket)]
    held = set(held_out)
    train = [s for s in sample_ids if s not in held]
    return train, held_out


def collate(items: list[dict], target: TargetParts, aux_index: list[int],
            last_index: int) -> Batch:
    B = len(items)
    T = max(item["input_ids"].numel() for item in items)
    hidden_states = items[0]["hidden_states"]
    H = hidden_states.shape[-1]
    aux = torch.zeros(B, T, len(aux_index) * H)
    embeds = torch.zeros(B, T, target.embed_weight.shape[1])
    last = torch.zeros(B, T, H)
    key_valid = torch.zeros(B, T, dtype=torch.bool)
    loss_rows = torch.zeros(B, T, dtype=torch.bool)
    for b, item in enumerate(items):
        n = item["input_ids"].numel()
        hs = item["hidden_states"].float()
        aux[b, :n] = hs[:, aux_index].reshape(n, -1)
        embeds[b, :n - 1] = target.embed(item["input_ids"][1:])
        last[b, :n - 1] = hs[1:, last_index]
        key_valid[b, :n - 1] = True
        loss_rows[b, :n - 2] = item["loss_mask"][2:].bool()
    return Batch(aux, embeds, torch.arange(T), key_valid, last, loss_rows)
