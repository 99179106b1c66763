"""Built-in draft heads: EAGLE-3 heads for the built-in targets, made by our
own extraction and training, cached and deterministic like the targets.

`build_head("tiny-eagle3")` returns a head directory vLLM's `eagle3` loads
(config.json + model.safetensors with d2t/t2d, training_log.json): the target
answers chat prompts from its training split (`extract --regenerate`), and a
head is trained on those hidden states (`train-eagle3`). About two minutes on
2 cores; the cache key covers the target's key and this recipe.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from vllm_specplug.models.build import (BUILD_INFO_FILE, build_cached, build_model,
                                        default_cache_dir)

HEAD_BUILDER_VERSION = 1  # bump when the recipe changes in a way the spec misses


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    name: str
    target: str              # a built-in model name
    num_prompts: int = 400   # training-split chat prompts the target answers
    max_new_tokens: int = 64
    epochs: int = 4
    ttt_steps: int = 3       # unrolled draft steps (the chain depth trained for)


HEAD_SPECS: dict[str, HeadSpec] = {
    "tiny-eagle3": HeadSpec("tiny-eagle3", target="tiny"),
}


def head_cache_key(spec: HeadSpec, target_dir: Path) -> str:
    payload = json.dumps({"spec": dataclasses.asdict(spec), "target": target_dir.name,
                          "builder": HEAD_BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _train_head(spec: HeadSpec, target_dir: Path, out: Path) -> None:
    from vllm_specplug.training import end_to_end as e2e

    work = out / "work"
    work.mkdir()
    data_dir, report = e2e.extract_training_data(target_dir, work, spec.num_prompts,
                                                 spec.max_new_tokens)
    trainer = e2e.train_head(target_dir, data_dir, out, spec.epochs, spec.ttt_steps)
    shutil.rmtree(work)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    (out / BUILD_INFO_FILE).write_text(json.dumps({
        "spec": dataclasses.asdict(spec), "target_dir": str(target_dir),
        "num_train_tokens": report.num_tokens,
        "train_seconds": trainer.state.seconds,
        "held_out_agreement": trainer.state.history[-1]["agreement"]}, indent=2))


def build_head(name: str, cache_dir: Path | None = None) -> Path:
    """The head's directory, trained (and its target built) if needed."""
    if name not in HEAD_SPECS:
        raise ValueError(f"unknown built-in head {name!r}; choose one of "
                         f"{sorted(HEAD_SPECS)}")
    spec = HEAD_SPECS[name]
    target_dir = build_model(spec.target, cache_dir)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / "models" / f"{spec.name}-{head_cache_key(spec, target_dir)}"
    return build_cached(final, lambda tmp: _train_head(spec, target_dir, tmp))
