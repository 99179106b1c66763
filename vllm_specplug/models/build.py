"""Build (train) the built-in Llama models on CPU, cached on disk.

`build_model("tiny")` returns a directory in Hugging Face format (config.json,
model.safetensors, tokenizer files) that vLLM and transformers load like any
hub model. Builds are deterministic for a spec (seed included) and a corpus,
and are cached under a key of both, so a second call costs nothing.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from vllm_specplug.cache import default_cache_dir
from vllm_specplug.models.corpus import Corpus, load_corpus

BUILD_INFO_FILE = "specplug_build.json"
BUILDER_VERSION = 1  # bump when the recipe changes in a way the spec misses


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    seq_len: int = 256  # training window, BOS included
    batch_size: int = 16
    num_steps: int = 400
    lr: float = 3e-3
    warmup_steps: int = 40
    seed: int = 0
    num_eval_windows: int = 64


MODEL_SPECS: dict[str, ModelSpec] = {
    # For tests: a cold build stays within a few minutes on 2 cores.
    "tiny": ModelSpec("tiny", vocab_size=4096, hidden_size=128,
                      num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=384),
    # For speed benchmarks (~33M parameters): built on demand, never in CI.
    # On our CPUs a tiny model's forward costs less than the engine's
    # per-step overhead, so speculation measured on it shows only overhead.
    "small": ModelSpec("small", vocab_size=8192, hidden_size=512,
                       num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, intermediate_size=1536,
                       batch_size=8, num_steps=600, lr=1.5e-3),
}


def cache_key(spec: ModelSpec, corpus: Corpus) -> str:
    payload = json.dumps({"spec": dataclasses.asdict(spec),
                          "corpus": corpus.digest,
                          "builder": BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # concurrent builders wait here
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve_spec(name_or_spec: str | ModelSpec) -> ModelSpec:
    if isinstance(name_or_spec, ModelSpec):
        return name_or_spec
    if name_or_spec not in MODEL_SPECS:
        raise ValueError(f"unknown built-in model {name_or_spec!r}; choose one "
                         f"of {sorted(MODEL_SPECS)}")
    return MODEL_SPECS[name_or_spec]


def build_cached(final: Path, build) -> Path:
    """`final`, made by `build(tmp_dir)` unless a finished build is there.

    Builds run beside the final place and are renamed into it, under a file
    lock: a killed build never leaves a directory that looks finished, and
    concurrent builders of the same key wait for one another."""
    with _file_lock(final.parent.parent / "locks" / f"{final.name}.lock"):
        if (final / BUILD_INFO_FILE).is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            build(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_resumable(final: Path, build) -> Path:
    """`final`, made by `build(work_dir)` in a work folder kept across runs.

    For builds long enough to be interrupted: `build` resumes from whatever it
    finds in `work_dir` (finished steps are skipped), and the folder is renamed
    into `final` only when whole, so an unfinished build never looks finished."""
    with _file_lock(final.parent.parent / "locks" / f"{final.name}.lock"):
        if (final / BUILD_INFO_FILE).is_file():
            return final
        work = final.parent / f".{final.name}.partial"
        work.mkdir(parents=True, exist_ok=True)
        build(work)
        if not (work / BUILD_INFO_FILE).is_file():
            raise RuntimeError(f"build of {final.name} wrote no {BUILD_INFO_FILE}")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(work, final)
    return final


def build_model(name_or_spec: str | ModelSpec = "tiny",
                cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the directory of the built model, building it if needed."""
    spec = resolve_spec(name_or_spec)
    corpus = load_corpus()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / "models" / f"{spec.name}-{cache_key(spec, corpus)}"

    def build(tmp: Path) -> None:
        from vllm_specplug.models.train import train_and_save

        train_and_save(spec, corpus, tmp, progress=progress)

    return build_cached(final, build)


def read_build_info(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / BUILD_INFO_FILE).read_text())
