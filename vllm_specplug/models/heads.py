"""Built-in draft models for the built-in targets, made by our own extraction
and training, cached and deterministic like the targets.

- `build_head("tiny-eagle3")`: an EAGLE-3 head vLLM's `eagle3` loads
  (config.json + model.safetensors with d2t/t2d, training_log.json).
- `build_head("tiny-mtp")`: `tiny` with one MTP layer, in MiMo's layout, which
  vLLM serves with `speculative_config={"method": "mtp"}` (the Llama target is
  written as the equivalent Qwen2 one; `draft_models/mtp_checkpoint.py`).

Both train on the same data: the target answers chat prompts from its
training split (`extract --regenerate`), cached once per target and recipe
(`build_training_data`). A cold build of both takes about three minutes on 2
cores; the cache keys cover the target's key and the recipe.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from vllm_specplug.models.build import (BUILD_INFO_FILE, build_cached, build_model,
                                        build_resumable, default_cache_dir)

HEAD_BUILDER_VERSION = 1  # bump when the recipe changes in a way the spec misses
DATA_BUILDER_VERSION = 1
EAGLE3, MTP = "eagle3", "mtp"


CORPUS, MAGPIE = "corpus", "magpie"


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    name: str
    target: str              # a built-in model name, or "smollm2"
    num_prompts: int = 400   # chat prompts the target answers
    max_new_tokens: int = 64
    epochs: int = 4
    ttt_steps: int = 3       # unrolled draft steps (the chain depth trained for)
    kind: str = EAGLE3
    # corpus: the built-in target's training split; magpie: written by the
    # target itself (training/magpie.py), disjoint from MT-Bench and HumanEval
    prompts: str = CORPUS
    draft_vocab_size: int | None = None  # None: the trainer's default
    max_model_len: int = 1024
    # Magpie recipes: prompts per extraction batch, also the engines'
    # max_num_seqs (None: 128 a batch, the engines' defaults).
    batch_size: int | None = None
    train_batch_size: int = 8
    needs_gpu: bool = False  # refused on a machine where torch sees no CUDA GPU
    # smollm2's weights the data is made with: float32 on CPUs without bf16
    # instructions, where vLLM's bf16 path runs several times slower
    target_dtype: str = "bfloat16"


HEAD_SPECS: dict[str, HeadSpec] = {
    "tiny-eagle3": HeadSpec("tiny-eagle3", target="tiny"),
    "tiny-mtp": HeadSpec("tiny-mtp", target="tiny", kind=MTP),
    # The CPU path: about 1000 prompts and answers of up to 192 tokens.
    "smollm2-eagle3": HeadSpec("smollm2-eagle3", target="smollm2", num_prompts=1024,
                               max_new_tokens=192, epochs=3, prompts=MAGPIE,
                               draft_vocab_size=8192, max_model_len=2048),
    # Small heads from SmolLM2's fp32 weights (target_dtype: on CPUs with
    # AVX2 only, vLLM's bf16 path runs several times slower; there every
    # token SmolLM2 reads or writes costs about 4.5 ms, and the data about
    # 500 of them a prompt). The same draft vocabulary as the others.
    # -small: a quarter of the CPU path's prompts, answers of up to 96 tokens
    # (the real-target tables, docs/results/smollm2_tables).
    "smollm2-eagle3-small": HeadSpec("smollm2-eagle3-small", target="smollm2",
                                     num_prompts=256, max_new_tokens=96, epochs=3,
                                     prompts=MAGPIE, draft_vocab_size=8192,
                                     max_model_len=2048, target_dtype="float32"),
    # -demo: the demo's (README command 1), 192 prompts, so that a cold demo
    # fits 25 minutes on such a machine.
    "smollm2-eagle3-demo": HeadSpec("smollm2-eagle3-demo", target="smollm2", num_prompts=192,
                                    max_new_tokens=96, epochs=3, prompts=MAGPIE,
                                    draft_vocab_size=8192, max_model_len=2048,
                                    target_dtype="float32"),
    # The GPU path: 8x the prompts, 2x the answer length, the same draft
    # vocabulary (so the two heads differ in data alone).
    "smollm2-eagle3-large": HeadSpec("smollm2-eagle3-large", target="smollm2",
                                     num_prompts=8192, max_new_tokens=384, epochs=4,
                                     prompts=MAGPIE, draft_vocab_size=8192,
                                     max_model_len=2048, batch_size=512,
                                     train_batch_size=16, needs_gpu=True),
}
# Fields added after heads were first cached: left out of a key at their default.
_LATER_FIELDS = {"prompts": CORPUS, "draft_vocab_size": None, "max_model_len": 1024,
                 "batch_size": None, "train_batch_size": 8, "needs_gpu": False,
                 "target_dtype": "bfloat16"}


def _key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def head_cache_key(spec: HeadSpec, target_dir: Path) -> str:
    fields = dataclasses.asdict(spec)
    if spec.kind == EAGLE3:
        fields.pop("kind")          # keys of EAGLE-3 heads built before MTP existed
    for name, default in _LATER_FIELDS.items():
        if fields[name] == default:
            fields.pop(name)
    return _key({"spec": fields, "target": target_dir.name,
                 "builder": HEAD_BUILDER_VERSION})


def _target_dir(spec: HeadSpec, cache_dir: Path | None) -> Path:
    if spec.target == "smollm2":
        from vllm_specplug.models.smollm2 import build_smollm2

        return build_smollm2(spec.target_dtype, cache_dir=cache_dir)
    return build_model(spec.target, cache_dir)


def build_training_data(spec: HeadSpec, target_dir: Path, root: Path) -> Path:
    """The extracted dataset a head of `spec` trains on (cached). Magpie data
    is built in a folder kept across runs: an interrupted build resumes (the
    prompts file, then the extraction's manifest, keep what was done)."""
    from vllm_specplug.models import end_to_end as e2e

    fields = {"target": target_dir.name, "num_prompts": spec.num_prompts,
              "max_new_tokens": spec.max_new_tokens, "builder": DATA_BUILDER_VERSION}
    if spec.prompts == MAGPIE:
        fields.update(prompts=MAGPIE, max_model_len=spec.max_model_len)
    if spec.batch_size is not None:
        fields.update(batch_size=spec.batch_size)
    final = root / "models" / f"{spec.target}-data-{_key(fields)}"

    def build(work: Path) -> None:
        if spec.prompts == MAGPIE:
            data_dir, report = e2e.extract_magpie_data(target_dir, work, spec.num_prompts,
                                                       spec.max_new_tokens, spec.max_model_len,
                                                       spec.batch_size)
        else:
            data_dir, report = e2e.extract_training_data(target_dir, work, spec.num_prompts,
                                                         spec.max_new_tokens)
        from vllm_specplug.extraction.dataset import read_manifest

        num_tokens = sum(r.num_tokens for r in read_manifest(data_dir))
        (work / BUILD_INFO_FILE).write_text(json.dumps(
            {"data_dir": Path(data_dir).name, "num_tokens": num_tokens}))

    return (build_resumable if spec.prompts == MAGPIE else build_cached)(final, build)


def _train(spec: HeadSpec, target_dir: Path, data_root: Path, out: Path) -> None:
    from vllm_specplug.models import end_to_end as e2e

    info = json.loads((data_root / BUILD_INFO_FILE).read_text())
    data_dir = str(data_root / info["data_dir"])
    if spec.kind == EAGLE3:
        trainer = e2e.train_head(target_dir, data_dir, out, spec.epochs, spec.ttt_steps,
                                 draft_vocab_size=spec.draft_vocab_size,
                                 batch_size=spec.train_batch_size,
                                 # about 100 held-out evaluations per 8000 prompts
                                 eval_every=max(20, spec.num_prompts // 80))
    else:
        trainer = e2e.train_mtp(target_dir, data_dir, out, spec.epochs, spec.ttt_steps)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    (out / BUILD_INFO_FILE).write_text(json.dumps({
        "spec": dataclasses.asdict(spec), "target_dir": str(target_dir),
        "num_train_tokens": info["num_tokens"],
        "train_seconds": trainer.state.seconds,
        "held_out_agreement": trainer.state.history[-1]["agreement"]}, indent=2))


def build_head(name: str, cache_dir: Path | None = None) -> Path:
    """The head's directory, trained (and its target and data built) if needed."""
    if name not in HEAD_SPECS:
        raise ValueError(f"unknown built-in head {name!r}; choose one of "
                         f"{sorted(HEAD_SPECS)}")
    spec = HEAD_SPECS[name]
    if spec.needs_gpu:
        _check_gpu(spec)
    target_dir = _target_dir(spec, cache_dir)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / "models" / f"{spec.name}-{head_cache_key(spec, target_dir)}"
    if (final / BUILD_INFO_FILE).is_file():
        return final
    with build_kv_space():
        data_root = build_training_data(spec, target_dir, root)
    # Magpie heads train long enough to be interrupted: their checkpoints stay.
    build = build_resumable if spec.prompts == MAGPIE else build_cached
    return build(final, lambda work: _train(spec, target_dir, data_root, work))


# KV cache (GiB) of the engines that write a head's data on CPU: Magpie
# samples hundreds of prompts at once, and at our engines' default of 1 GiB
# SmolLM2's batch no longer fits and is preempted over and over.
BUILD_KVCACHE_GIB = "4"


@contextlib.contextmanager
def build_kv_space():
    """`VLLM_CPU_KVCACHE_SPACE` = BUILD_KVCACHE_GIB while the data is built,
    unless the caller set it (theirs wins); restored after."""
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        yield
        return
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = BUILD_KVCACHE_GIB
    try:
        yield
    finally:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


class GpuRequiredError(ValueError):
    """A GPU recipe asked for where torch sees no CUDA GPU."""


def _check_gpu(spec: HeadSpec) -> None:
    import torch

    if not torch.cuda.is_available():
        cpu_paths = sorted(n for n, s in HEAD_SPECS.items()
                           if s.target == spec.target and not s.needs_gpu)
        raise GpuRequiredError(
            f"{spec.name} is the GPU recipe ({spec.num_prompts} prompts, answers of up "
            f"to {spec.max_new_tokens} tokens) and torch sees no CUDA GPU here; build "
            f"{' or '.join(cpu_paths)} on CPU, or this one on a GPU machine "
            "(docs/training.md)")
