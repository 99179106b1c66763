"""Built-in draft models for the built-in targets, made by our own extraction
and training, cached and deterministic like the targets.

- `build_head("tiny-eagle3")`: an EAGLE-3 head vLLM's `eagle3` loads
  (config.json + model.safetensors with d2t/t2d, training_log.json).
- `build_head("tiny-mtp")`: `tiny` with one MTP layer, in MiMo's layout, which
  vLLM serves with `speculative_config={"method": "mtp"}` (the Llama target is
  written as the equivalent Qwen2 one; `training/mtp_checkpoint.py`).

Both train on the same data: the target answers chat prompts from its
training split (`extract --regenerate`), cached once per target and recipe
(`build_training_data`). A cold build of both takes about three minutes on 2
cores; the cache keys cover the target's key and the recipe.
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
DATA_BUILDER_VERSION = 1
EAGLE3, MTP = "eagle3", "mtp"


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    name: str
    target: str              # a built-in model name
    num_prompts: int = 400   # training-split chat prompts the target answers
    max_new_tokens: int = 64
    epochs: int = 4
    ttt_steps: int = 3       # unrolled draft steps (the chain depth trained for)
    kind: str = EAGLE3


HEAD_SPECS: dict[str, HeadSpec] = {
    "tiny-eagle3": HeadSpec("tiny-eagle3", target="tiny"),
    "tiny-mtp": HeadSpec("tiny-mtp", target="tiny", kind=MTP),
}


def _key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def head_cache_key(spec: HeadSpec, target_dir: Path) -> str:
    fields = dataclasses.asdict(spec)
    if spec.kind == EAGLE3:
        fields.pop("kind")          # keys of EAGLE-3 heads built before MTP existed
    return _key({"spec": fields, "target": target_dir.name,
                 "builder": HEAD_BUILDER_VERSION})


def build_training_data(spec: HeadSpec, target_dir: Path, root: Path) -> Path:
    """The extracted dataset a head of `spec` trains on (cached)."""
    from vllm_specplug.training import end_to_end as e2e

    key = _key({"target": target_dir.name, "num_prompts": spec.num_prompts,
                "max_new_tokens": spec.max_new_tokens, "builder": DATA_BUILDER_VERSION})
    final = root / "models" / f"{spec.target}-data-{key}"

    def build(tmp: Path) -> None:
        data_dir, report = e2e.extract_training_data(target_dir, tmp, spec.num_prompts,
                                                     spec.max_new_tokens)
        (tmp / BUILD_INFO_FILE).write_text(json.dumps(
            {"data_dir": Path(data_dir).name, "num_tokens": report.num_tokens}))

    return build_cached(final, build)


def _train(spec: HeadSpec, target_dir: Path, data_root: Path, out: Path) -> None:
    from vllm_specplug.training import end_to_end as e2e

    info = json.loads((data_root / BUILD_INFO_FILE).read_text())
    data_dir = str(data_root / info["data_dir"])
    trainer = (e2e.train_head if spec.kind == EAGLE3 else e2e.train_mtp)(
        target_dir, data_dir, out, spec.epochs, spec.ttt_steps)
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
    target_dir = build_model(spec.target, cache_dir)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / "models" / f"{spec.name}-{head_cache_key(spec, target_dir)}"
    if (final / BUILD_INFO_FILE).is_file():
        return final
    data_root = build_training_data(spec, target_dir, root)
    return build_cached(final, lambda tmp: _train(spec, target_dir, data_root, tmp))
