"""CPU training recipe of the built-in Llamas (called by `build.build_model`)."""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_specplug.models.corpus import Corpus
from vllm_specplug.models.tokenizer import (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN,
                                            save_hf_tokenizer, train_tokenizer)

# Thread count changes float reduction order; fixing it keeps builds
# bit-identical across machines with different core counts.
TRAIN_THREADS = 2


def encode_stream(tokenizer, texts, eos_id: int) -> torch.Tensor:
    """[num_tokens] int64: documents joined by EOS, without BOS."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids += encoding.ids + [eos_id]
    return torch.tensor(ids, dtype=torch.long)


def sample_windows(stream: torch.Tensor, num: int, seq_len: int, bos_id: int,
                   generator: torch.Generator) -> torch.Tensor:
    """[num, seq_len] int64 windows, each starting with BOS like a prompt."""
    starts = torch.randint(0, stream.numel() - seq_len, (num,), generator=generator)
    offsets = torch.arange(seq_len - 1)
    body = stream[starts[:, None] + offsets[None, :]]
    return torch.cat([torch.full((num, 1), bos_id), body], dim=1)


def make_model(spec, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
        tie_word_embeddings=False, torch_dtype="float32")
    return LlamaForCausalLM(config)


def lr_at(step: int, spec) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    frac = (step - spec.warmup_steps) / max(1, spec.num_steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def train_steps(model, stream, spec, bos_id, progress: bool) -> float:
    """Run `spec.num_steps` AdamW steps; return the last smoothed loss."""
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    smoothed = float("nan")
    bar = tqdm(range(spec.num_steps), desc=f"train {spec.name}",
               disable=not progress, mininterval=2.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        batch = sample_windows(stream, spec.batch_size, spec.seq_len, bos_id,
                               generator)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()
        smoothed = value if step == 0 else 0.95 * smoothed + 0.05 * value
        bar.set_postfix(loss=f"{smoothed:.3f}", refresh=False)
    return smoothed


@torch.no_grad()
def held_out_loss(model, stream, spec, bos_id) -> float:
    """Mean next-token cross-entropy (nats) on fixed held-out windows."""
    generator = torch.Generator().manual_seed(spec.seed + 1)
    windows = sample_windows(stream, spec.num_eval_windows, spec.seq_len,
                             bos_id, generator)
    model.eval()
    losses = [model(input_ids=w[None], labels=w[None]).loss for w in windows]
    return torch.stack(losses).mean().item()


def unigram_loss(train_stream, eval_stream, vocab_size: int) -> float:
    """Cross-entropy of a smoothed unigram model: the bar to clear."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return -log_probs[eval_stream].mean().item()


def train_and_save(spec, corpus: Corpus, out_dir: Path, progress: bool = True):
    """Train tokenizer and model, evaluate, write everything to `out_dir`."""
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        tokenizer = train_tokenizer(corpus.train, spec.vocab_size)
        eos_id, bos_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(BOS_TOKEN)
        train_stream = encode_stream(tokenizer, corpus.train, eos_id)
        eval_stream = encode_stream(tokenizer, corpus.held_out, eos_id)
        model = make_model(spec, tokenizer)
        final_train_loss = train_steps(model, train_stream, spec, bos_id, progress)
        eval_loss = held_out_loss(model, eval_stream, spec, bos_id)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    model.generation_config.save_pretrained(str(out_dir))
    save_hf_tokenizer(tokenizer, out_dir, spec.max_position_embeddings)
    info = {
        "spec": dataclasses.asdict(spec), "corpus_digest": corpus.digest,
        "num_params": sum(p.numel() for p in model.parameters()),
        "num_train_tokens": train_stream.numel(),
        "num_held_out_tokens": eval_stream.numel(),
        "train_loss": final_train_loss, "held_out_loss": eval_loss,
        "unigram_held_out_loss": unigram_loss(train_stream, eval_stream,
                                              tokenizer.get_vocab_size()),
        "build_seconds": time.perf_counter() - start,
    }
    (out_dir / "specplug_build.json").write_text(json.dumps(info, indent=2))
    return info
