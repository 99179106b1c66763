"""Train an MTP layer on an extracted dataset (`vllm-specplug train-mtp`).

Same loop as the EAGLE-3 trainer (`trainer.HeadTrainer`): soft cross-entropy
against the target's distribution of token t+2, unrolled for `ttt_steps`
draft steps (the layer reused on its own output, as vLLM drafts K > 1 tokens
with one MTP layer), loss weight `step_weight ** k`, held-out top-1
agreement per step. The layer reads the target's last hidden state (the
dataset's layer n, before the final norm: what vLLM hands an MTP drafter),
and predicts over the target's whole vocabulary with the target's lm_head.
The result is an MTP-capable copy of the target (`mtp_checkpoint.py`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from vllm_specplug.training.batches import Batch, collate
from vllm_specplug.draft_models.mtp_checkpoint import target_kind, write_mtp_model
from vllm_specplug.draft_models.mtp_model import MtpConfig, MtpLayer
from vllm_specplug.training.trainer import HeadTrainer, score_steps
from vllm_specplug.training.vocab import check_token_ids


def make_mtp_layer(target_config: dict, target, seed: int, warm_start: bool = True
                   ) -> MtpLayer:
    """A fresh layer; `warm_start` copies the target's final norm into the
    layer's final norm (its output meets the target's lm_head directly)."""
    layer = MtpLayer(MtpConfig.from_target(target_config))
    layer.reset_parameters(torch.Generator().manual_seed(seed))
    if warm_start:
        with torch.no_grad():
            layer.final_layernorm.weight.copy_(target.norm_weight)
    return layer


class MtpTrainer(HeadTrainer):
    def _check_data(self, info) -> None:
        if info.num_hidden_layers not in info.layer_ids:
            raise ValueError(
                f"dataset layers {info.layer_ids}: MTP training needs the last layer "
                f"({info.num_hidden_layers}), the hidden state an MTP layer reads; "
                "extract with the default --layers")
        self.last_index = info.layer_ids.index(info.num_hidden_layers)

    def _make_head(self, info) -> MtpLayer:
        target_kind(self.target.config, Path(self.config.target))  # refuse early
        vocab_size = int(self.target.config["vocab_size"])
        for index in range(len(self.held_out)):     # damage found now, not at step 0
            check_token_ids(self.held_out, self.held_out[index], vocab_size)
        return make_mtp_layer(self.target.config, self.target, self.config.seed)

    def _collate(self, items: list[dict]) -> Batch:
        # the "auxiliary" input is the last layer itself, unshifted: row t holds h_t
        return collate(items, self.target, [self.last_index], self.last_index)

    def _losses(self, batch: Batch, with_agreement: bool = False) -> list:
        outputs = self.head(batch.aux_hidden, batch.embeds, batch.positions,
                            batch.key_valid, self.config.ttt_steps)
        lm_head = self.loss_target.lm_head_weight
        with torch.no_grad():
            target_logits = self.loss_target.logits(batch.target_last)
            soft = torch.softmax(target_logits, dim=-1)
            target_top1 = target_logits.argmax(-1) if with_agreement else None
        return score_steps([y @ lm_head.T for y in outputs], batch, soft, target_top1)

    def _save_head(self, out: Path) -> None:
        write_mtp_model(self.config.target, self.head.checkpoint_tensors(0), 1, out)
