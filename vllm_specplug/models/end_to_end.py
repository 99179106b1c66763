"""Prompts -> extracted data -> trained EAGLE-3 head (vLLM's `eagle3`) or MTP
layer (vLLM's `mtp`), on a built-in target. Used by the built-in heads
(models/heads.py), examples/eagle3_end_to_end.py and the engine tests."""
from __future__ import annotations

import json
from pathlib import Path

from vllm_specplug.extraction.pipeline import ExtractOptions, run_extract
from vllm_specplug.models.corpus import (chat_conversations, held_out_prompts,
                                         train_prompts)
from vllm_specplug.training.trainer import (TrainConfig, Trainer, head_config,
                                            make_head, run_training)


def write_train_prompts(path: str | Path, num_prompts: int) -> str:
    """Chat prompts from the target's training split (JSONL, no answers: the
    target writes them with --regenerate)."""
    lines = [json.dumps(c) for c in chat_conversations(train_prompts(num_prompts))]
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


def eval_prompt_ids(model_dir, num_prompts: int) -> list[dict]:
    """Held-out chat prompts, templated, as vLLM token prompts."""
    from transformers import AutoTokenizer

    from vllm_specplug.extraction.prompts import template_for_generation

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [{"prompt_token_ids": template_for_generation(tokenizer, c["messages"])}
            for c in chat_conversations(held_out_prompts(num_prompts))]


def extract_training_data(model_dir, work: Path, num_prompts: int,
                          max_new_tokens: int):
    prompts = write_train_prompts(work / "train_prompts.jsonl", num_prompts)
    options = ExtractOptions(model=str(model_dir), prompts=prompts,
                             out=str(work / "data"), regenerate=True,
                             max_new_tokens=max_new_tokens, batch_size=64,
                             max_model_len=1024)
    return options.out, run_extract(options)


def extract_magpie_data(model_dir, work: Path, num_prompts: int, max_new_tokens: int,
                        max_model_len: int = 2048, batch_size: int | None = None):
    """Prompts the target writes itself (kept in `work` once written), then its
    answers and hidden states (resumable: the extraction's manifest).
    `batch_size`: prompts a batch and the engines' max_num_seqs (None: 128
    prompts a batch at the engines' defaults)."""
    from vllm_specplug.extraction.pipeline import model_num_layers
    from vllm_specplug.public_sets import PUBLIC_SETS, question_texts
    from vllm_specplug.engine import running_llm
    from vllm_specplug.training.magpie import sample_prompts, write_prompts_file

    prompts = work / "magpie_prompts.jsonl"
    if not prompts.is_file():
        exclude = {name: question_texts(name) for name in PUBLIC_SETS}
        # the checkpoint's own dtype, as the extraction uses: vLLM's "auto"
        # would sample a float32 checkpoint in bf16
        dtype = model_num_layers(str(model_dir))[2]
        with running_llm(model_dir, dtype=dtype, max_model_len=max_model_len,
                         max_num_seqs=batch_size or 256) as llm:
            texts, report = sample_prompts(llm, num_prompts, exclude)
        (work / "magpie_report.json").write_text(json.dumps(report.as_dict(), indent=2))
        write_prompts_file(prompts, texts)
    options = ExtractOptions(model=str(model_dir), prompts=str(prompts),
                             out=str(work / "data"), regenerate=True,
                             max_new_tokens=max_new_tokens, batch_size=batch_size or 128,
                             max_model_len=max_model_len,
                             engine_kwargs={"max_num_seqs": batch_size} if batch_size else {})
    return options.out, run_extract(options)


def train_head(model_dir, data_dir: str, out_dir: Path, epochs: int,
               ttt_steps: int = 3, log=print, draft_vocab_size: int | None = None,
               batch_size: int = 8, eval_every: int = 20) -> Trainer:
    config = TrainConfig(data=data_dir, target=str(model_dir), out=str(out_dir),
                         epochs=epochs, ttt_steps=ttt_steps, eval_every=eval_every,
                         draft_vocab_size=draft_vocab_size, batch_size=batch_size)
    return run_training(config, log=log)


def write_untrained_head(trainer: Trainer, out_dir: Path, seed: int = 1) -> Path:
    """Same shape and vocabulary as the trained head, every weight random."""
    config = head_config(trainer.target, trainer.dataset.info, trainer.vocab)
    head = make_head(config, trainer.vocab, trainer.target, seed, warm_start=False)
    head.save_pretrained(out_dir)
    return out_dir


def eagle3_config(head_dir, num_speculative_tokens: int) -> dict:
    return {"method": "eagle3", "model": str(head_dir),
            "num_speculative_tokens": num_speculative_tokens}


def train_mtp(model_dir, data_dir: str, out_dir: Path, epochs: int, ttt_steps: int = 3,
              log=print):
    """An MTP layer for `model_dir`; `out_dir` becomes its MTP-capable copy."""
    from vllm_specplug.training.mtp_trainer import MtpTrainer

    config = TrainConfig(data=data_dir, target=str(model_dir), out=str(out_dir),
                         epochs=epochs, ttt_steps=ttt_steps, eval_every=20)
    return run_training(config, log=log, trainer_cls=MtpTrainer)


def write_untrained_mtp(model_dir, out_dir: Path, seed: int = 1) -> Path:
    """`model_dir` with an MTP layer as training starts it (random weights)."""
    from vllm_specplug.draft_models.mtp_checkpoint import write_mtp_model
    from vllm_specplug.training.mtp_trainer import make_mtp_layer
    from vllm_specplug.draft_models.target import TargetParts

    target = TargetParts.load(model_dir)
    layer = make_mtp_layer(target.config, target, seed)
    return write_mtp_model(model_dir, layer.checkpoint_tensors(0), 1, out_dir)


def mtp_config(num_speculative_tokens: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
