"""Draft vocabulary from loss-masked token frequencies (EAGLE-3's d2t/t2d, FR-Spec).

The draft head's lm_head covers only the `draft_vocab_size` target tokens seen
most often in responses (FR-Spec, arXiv 2502.14856). vLLM maps a draft id `i`
back with `target_id = i + d2t[i]`; `t2d[target_id]` says whether a target
token is in the draft vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_specplug.extraction.errors import DatasetError
from vllm_specplug.files import write_text_atomic


@dataclass
class DraftVocab:
    target_ids: torch.Tensor  # [draft_vocab_size] int64, ascending target ids
    counts: torch.Tensor      # [vocab_size] int64, loss-masked frequencies
    ranking: torch.Tensor     # [vocab_size] int64, target ids by frequency

    @property
    def d2t(self) -> torch.Tensor:  # [draft_vocab_size] int64
        return self.target_ids - torch.arange(self.target_ids.numel())

    def t2d(self, vocab_size: int) -> torch.Tensor:  # [vocab_size] bool
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    @property
    def size(self) -> int:
        return self.target_ids.numel()


def check_token_ids(dataset, item: dict, vocab_size: int) -> dict:
    if item["input_ids"].numel() and int(item["input_ids"].max()) >= vocab_size:
        raise DatasetError(
            f"{getattr(dataset, 'root', 'dataset')}: sample {item['sample_id']} has "
            f"token id {int(item['input_ids'].max())}, beyond the target's vocabulary "
            f"({vocab_size}): extracted from another model? Train with the --target "
            "the dataset was extracted from")
    return item


def count_tokens(dataset, vocab_size: int) -> torch.Tensor:
    """Loss-masked token counts over the whole dataset: [vocab_size] int64.
    Reads every sample once, so damaged samples stop training before it starts."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for index in tqdm(range(len(dataset)), desc="count tokens", unit="sample"):
        item = check_token_ids(dataset, dataset[index], vocab_size)
        ids = item["input_ids"][item["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """Most frequent tokens first; ties (and unseen tokens) by lower id."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in "
                         f"[1, {vocab_size}] (the target's vocabulary size)")
    # Stable sort on -count keeps ascending ids among equal counts.
    ranking = torch.sort(-counts, stable=True).indices
    target_ids = torch.sort(ranking[:draft_vocab_size]).values
    return DraftVocab(target_ids, counts, ranking)


def export_token_ranking(vocab: DraftVocab, path: str | Path) -> None:
    """FR-Spec-style token map: target ids by loss-masked frequency, as JSON."""
    seen = int((vocab.counts > 0).sum())
    write_text_atomic(json.dumps({
        "ranking": vocab.ranking[:seen].tolist(),
        "counts": vocab.counts[vocab.ranking[:seen]].tolist(),
        "draft_vocab_size": vocab.size,
        "covered_fraction": float(vocab.counts[vocab.target_ids].sum()
                                  / max(1, int(vocab.counts.sum()))),
    }), path)
