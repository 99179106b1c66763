"""Train a draft head on an extracted dataset: EAGLE-3 here (`vllm-specplug
train-eagle3`), MTP in `mtp_trainer.py` (`vllm-specplug train-mtp`).

Loss (EAGLE-3 / HASS style): for each unrolled step k, soft cross-entropy
between the draft's distribution and the target's (renormalised over the draft
vocabulary), averaged over rows that predict a response token, weighted
`step_weight ** k`. Held-out metric: top-1 agreement with the target per step,
which is the greedy acceptance rate of that draft position given the earlier
ones were accepted.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_specplug.extraction.dataset import HiddenStatesDataset
from vllm_specplug.files import check_writable_dir, write_text_atomic
from vllm_specplug.training import checkpoint as ckpt
from vllm_specplug.training.batches import Batch, collate, split_ids
from vllm_specplug.draft_models.eagle3_model import Eagle3Head, HeadConfig
from vllm_specplug.draft_models.target import TargetParts
from vllm_specplug.training.vocab import (DraftVocab, build_draft_vocab,
                                          check_token_ids, count_tokens,
                                          export_token_ranking)


@dataclass
class TrainConfig:
    data: str
    target: str
    out: str
    draft_vocab_size: int | None = None   # default: min(32000, vocab // 2)
    ttt_steps: int = 3
    step_weight: float = 0.8
    epochs: int = 4
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 20
    held_out_fraction: float = 0.1
    eval_every: int = 50
    checkpoint_every: int = 100
    seed: int = 0
    # "auto": CUDA when torch sees a GPU, else CPU. On CUDA the head's forward
    # runs under bf16 autocast (fp32 weights, optimizer and labels).
    device: str = "auto"


@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0
    history: list = field(default_factory=list)   # eval records


def resolve_device(name: str) -> torch.device:
    """`TrainConfig.device` -> a torch device; a clear error for one that is absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name}: not a torch device ({error}); "
                         "use auto, cpu or cuda") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA GPU here; "
                         "use --device cpu (or auto)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: training runs on cpu or cuda")
    return device


def layer_roles(layer_ids: list[int], num_hidden_layers: int) -> tuple[list[int], int]:
    """Indices (into the dataset's layers) of the auxiliary layers and the last."""
    if num_hidden_layers not in layer_ids or len(layer_ids) < 2:
        raise ValueError(
            f"dataset layers {layer_ids}: EAGLE-3 training needs the last layer "
            f"({num_hidden_layers}) for the target's distribution and at least one "
            "auxiliary layer; extract with the default --layers")
    aux = [i for i, l in enumerate(layer_ids) if l != num_hidden_layers]
    return aux, layer_ids.index(num_hidden_layers)


def head_config(target: TargetParts, info, vocab: DraftVocab) -> HeadConfig:
    c = target.config
    heads = int(c["num_attention_heads"])
    rope = c.get("rope_parameters") or {}
    return HeadConfig(
        hidden_size=int(c["hidden_size"]), intermediate_size=int(c["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads", heads)),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        vocab_size=int(c["vocab_size"]), draft_vocab_size=vocab.size,
        target_hidden_size=info.hidden_size,
        aux_layer_ids=[l for l in info.layer_ids if l != info.num_hidden_layers],
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)))


def make_head(config: HeadConfig, vocab: DraftVocab, target: TargetParts,
              seed: int, warm_start: bool = True) -> Eagle3Head:
    """A fresh head; `warm_start` copies the target's norm and the draft
    vocabulary's lm_head rows (the rest is random either way)."""
    head = Eagle3Head(config)
    head.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        head.d2t.copy_(vocab.d2t)
        head.t2d.copy_(vocab.t2d(config.vocab_size))
        if warm_start:
            head.lm_head.weight.copy_(target.lm_head_weight[vocab.target_ids])
            head.norm.weight.copy_(target.norm_weight)
    return head


def step_losses(head: Eagle3Head, batch: Batch, target: TargetParts,
                draft_ids: torch.Tensor, num_steps: int, with_agreement: bool = False):
    """Per step: (soft CE loss, top-1 agreement count, number of rows).
    The agreement needs the target's full-vocabulary logits: evaluation only
    (the count is 0 without `with_agreement`)."""
    logits = head(batch.aux_hidden, batch.embeds, batch.positions, batch.key_valid,
                  num_steps)
    with torch.no_grad():
        soft = torch.softmax(target.logits(batch.target_last, draft_ids), dim=-1)
        target_top1 = target.logits(batch.target_last).argmax(-1) if with_agreement else None
    return score_steps(logits, batch, soft, target_top1, head.draft_to_target)


def score_steps(step_logits: list[torch.Tensor], batch: Batch, soft: torch.Tensor,
                target_top1: torch.Tensor | None, to_target=None) -> list:
    """Per unrolled step k: soft cross-entropy of the draft's logits against
    the target's distribution `soft` over rows that predict a response token
    (and have k steps of chain before them), top-1 agreement with
    `target_top1` (draft ids mapped by `to_target`), and the row count."""
    T = batch.positions.numel()
    results = []
    for k, logits in enumerate(step_logits):
        rows = batch.loss_rows & (batch.positions >= k)[None]
        num = int(rows.sum())
        ce = -(soft[rows] * F.log_softmax(logits[rows], dim=-1)).sum(-1)
        hits = 0
        if target_top1 is not None:
            draft_top1 = logits[rows].argmax(-1)
            if to_target is not None:
                draft_top1 = to_target(draft_top1)
            hits = int((draft_top1 == target_top1[rows]).sum())
        results.append((ce.mean() if num else ce.sum(), hits, num))
    return results


class HeadTrainer:
    """The training loop every draft head shares: dataset split, AdamW with
    warm-up and cosine decay, TTT step losses, held-out agreement,
    deterministic resumable order, pickle-free checkpoints, final save.
    Subclasses say what the head is, what it reads and how it is saved."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        check_writable_dir(config.out)
        self.dataset = HiddenStatesDataset(config.data)   # checks every shard header
        info = self.dataset.info
        self._check_data(info)
        self.target = TargetParts.load(config.target)
        if int(self.target.config["hidden_size"]) != info.hidden_size:
            raise ValueError(f"--target {config.target} has hidden size "
                             f"{self.target.config['hidden_size']}, the dataset "
                             f"{info.hidden_size}: extracted from another model?")
        ids = [r.sample_id for r in self.dataset.records]
        train_ids, held_ids = split_ids(ids, config.held_out_fraction)
        if not train_ids:
            raise ValueError(f"--data {config.data}: no training samples")
        self.train = self.dataset.subset(train_ids)
        self.held_out = self.dataset.subset(held_ids)
        # Batches are collated on the host (self.target), losses computed on
        # the device (self.loss_target: the same tensors on CPU).
        self.loss_target = self.target.to(self.device)
        self.head = self._make_head(info).to(self.device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=config.lr,
                                           weight_decay=0.0)
        self.steps_per_epoch = math.ceil(len(self.train) / config.batch_size)
        self.total_steps = config.epochs * self.steps_per_epoch
        self.state = TrainState()
        self._prefetch = (_Prefetcher(self.batch_at, self.total_steps)
                          if self.device.type == "cuda" else None)

    # -- what a head is, reads and writes (subclasses)
    def _check_data(self, info) -> None:
        """Raise ValueError naming what the dataset lacks for this head."""

    def _make_head(self, info) -> torch.nn.Module:
        raise NotImplementedError

    def _collate(self, items: list[dict]) -> Batch:
        raise NotImplementedError

    def _losses(self, batch: Batch, with_agreement: bool = False) -> list:
        """Per unrolled step: (soft CE loss, top-1 agreement count, rows)."""
        raise NotImplementedError

    def _check_resumed(self) -> None:
        """Raise CheckpointError if the resumed head does not fit the data."""

    def _save_head(self, out: Path) -> None:
        raise NotImplementedError

    def resume(self) -> bool:
        state = ckpt.load_latest(self.config.out, self.head, self.optimizer)
        if state is None:
            return False
        try:
            self.state = TrainState(**state)
        except TypeError as error:
            raise ckpt.CheckpointError(f"{self.config.out}/checkpoints: trainer state "
                                       f"unusable ({error}); pass --no-resume") from error
        self._check_resumed()
        return True

    def batch_at(self, step: int) -> Batch:
        """Deterministic order: a seeded permutation per epoch (resumable)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.config.seed * 1000 + epoch)
        order = torch.randperm(len(self.train), generator=generator)
        chosen = order[index * self.config.batch_size:(index + 1) * self.config.batch_size]
        return self._collate([self.train[int(i)] for i in chosen])

    def learning_rate(self, step: int) -> float:
        warmup = max(1, self.config.warmup_steps)
        if step < warmup:
            return self.config.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        return self.config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    def _device_losses(self, batch: Batch, with_agreement: bool = False) -> list:
        """`_losses` on the trainer's device, the head under bf16 autocast on CUDA."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            return self._losses(batch.to(self.device), with_agreement)

    def train_step(self, step: int) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(step)
        batch = self._prefetch.take(step) if self._prefetch else self.batch_at(step)
        results = self._device_losses(batch)
        loss = sum(self.config.step_weight ** k * ce for k, (ce, _, _) in enumerate(results))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out top-1 agreement and loss per unrolled step."""
        agree = [0] * self.config.ttt_steps
        rows = [0] * self.config.ttt_steps
        losses = [0.0] * self.config.ttt_steps
        for start in range(0, len(self.held_out), self.config.batch_size):
            items = [self.held_out[i] for i in
                     range(start, min(len(self.held_out), start + self.config.batch_size))]
            for k, (ce, hits, num) in enumerate(
                    self._device_losses(self._collate(items), with_agreement=True)):
                agree[k] += hits
                rows[k] += num
                losses[k] += float(ce) * num
        return {"agreement": [a / max(1, n) for a, n in zip(agree, rows)],
                "loss": [l / max(1, n) for l, n in zip(losses, rows)],
                "num_rows": rows}

    def record_eval(self, step: int, train_loss: float | None) -> dict:
        record = {"step": step, "epoch": step / self.steps_per_epoch,
                  "train_loss": train_loss, **self.evaluate()}
        self.state.history.append(record)
        return record

    def checkpoint(self) -> None:
        ckpt.save_checkpoint(self.config.out, self.state.step, self.head,
                             self.optimizer, asdict(self.state))

    def fit(self, stop_after: int | None = None) -> bool:
        """Train up to the last step; False when stopped early by `stop_after`."""
        from tqdm import tqdm

        with tqdm(total=self.total_steps, initial=self.state.step, desc="train",
                  unit="step") as bar:    # closed on errors too: they print below it
            while self.state.step < self.total_steps:
                if stop_after is not None and self.state.step >= stop_after:
                    return False
                self._fit_step(bar)
        return True

    def _fit_step(self, bar) -> None:
        start = time.perf_counter()
        loss = self.train_step(self.state.step)
        self.state.seconds += time.perf_counter() - start
        self.state.step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        step, config = self.state.step, self.config
        if step % config.eval_every == 0 or step == self.total_steps:
            bar.write(_format_eval(self.record_eval(step, loss)))
        if step % config.checkpoint_every == 0 or step == self.total_steps:
            self.checkpoint()

    def save_final(self) -> Path:
        out = Path(self.config.out)
        self._save_head(out)
        write_text_atomic(json.dumps({
            "config": asdict(self.config), "seconds": self.state.seconds,
            "num_train_samples": len(self.train),
            "num_held_out_samples": len(self.held_out),
            "total_steps": self.total_steps, "history": self.state.history}, indent=1),
            out / "training_log.json")
        return out


class Trainer(HeadTrainer):
    """EAGLE-3: auxiliary layers in, draft vocabulary out (d2t/t2d), saved in
    vLLM's eagle3 layout."""

    def _check_data(self, info) -> None:
        self.aux_index, self.last_index = layer_roles(info.layer_ids,
                                                      info.num_hidden_layers)

    def _make_head(self, info) -> Eagle3Head:
        self.vocab = self._vocab()
        self.draft_target_ids = self.vocab.target_ids.to(self.device)
        return make_head(head_config(self.target, info, self.vocab), self.vocab,
                         self.target, self.config.seed)

    def _vocab(self) -> DraftVocab:
        vocab_size = int(self.target.config["vocab_size"])
        size = self.config.draft_vocab_size or min(32000, vocab_size // 2)
        vocab = build_draft_vocab(count_tokens(self.train, vocab_size), size)
        for index in range(len(self.held_out)):     # damage found now, not at step 0
            check_token_ids(self.held_out, self.held_out[index], vocab_size)
        export_token_ranking(vocab, Path(self.config.out) / "token_ranking.json")
        return vocab

    def _collate(self, items: list[dict]) -> Batch:
        return collate(items, self.target, self.aux_index, self.last_index)

    def _losses(self, batch: Batch, with_agreement: bool = False) -> list:
        return step_losses(self.head, batch, self.loss_target, self.draft_target_ids,
                           self.config.ttt_steps, with_agreement)

    def _check_resumed(self) -> None:
        if not torch.equal(self.head.d2t.cpu(), self.vocab.d2t):
            raise ckpt.CheckpointError(
                f"{self.config.out}/checkpoints: the checkpoint's draft vocabulary "
                f"differs from the one --data {self.config.data} gives now (the "
                "dataset changed?); resume with the data it was trained on, or pass "
                "--no-resume to start over")

    def _save_head(self, out: Path) -> None:
        self.head.save_pretrained(out)


class _Prefetcher:
    """Collates the next step's batch in a thread while the GPU trains on this
    one (host reads and collation would otherwise leave the GPU idle)."""

    def __init__(self, batch_at, total_steps: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._batch_at = batch_at
        self._total_steps = total_steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collate")
        self._pending: tuple[int, object] | None = None

    def take(self, step: int) -> Batch:
        if self._pending is not None and self._pending[0] == step:
            batch = self._pending[1].result()
        else:
            batch = self._batch_at(step)
        self._pending = None
        if step + 1 < self._total_steps:
            self._pending = (step + 1, self._pool.submit(self._batch_at, step + 1))
        return batch


def run_training(config: TrainConfig, resume: bool = True, log=print,
                 stop_after: int | None = None,
                 trainer_cls: type[HeadTrainer] = Trainer) -> HeadTrainer:
    """Train to the end (or, for tests of resumption, stop after `stop_after`
    steps as a killed run would: no final checkpoint, no head written)."""
    trainer = trainer_cls(config)
    if resume and trainer.resume():
        log(f"resumed from step {trainer.state.step}")
    else:
        log(_format_eval(trainer.record_eval(0, None)))
    if trainer.fit(stop_after):
        trainer.save_final()
    return trainer


def _format_eval(record: dict) -> str:
    agreement = " ".join(f"{a:.3f}" for a in record["agreement"])
    loss = "-" if record["train_loss"] is None else f"{record['train_loss']:.3f}"
    return (f"step {record['step']:5d} epoch {record['epoch']:.2f} train loss "
            f"{loss}  held-out top-1 agreement per step: {agreement}")
