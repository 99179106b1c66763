"""Sharded safetensors dataset of hidden states, its manifest, and its reader.

Layout of a dataset directory (docs/extraction.md):

    dataset.json            format, model, layer ids, hidden size, dtype
    manifest.jsonl          one line per sample: sample_id, source_line,
                            num_tokens, shard, offset
    shards/shard-00000.safetensors
        input_ids      [N] int64         the samples' tokens, concatenated
        hidden_states  [N, L, H] dtype   layer ids in dataset.json order
        loss_mask      [N] uint8         1 on assistant-response tokens

A sample is rows [offset, offset + num_tokens) of its shard. Shards are written
atomically and listed in the manifest only after they are on disk, so a killed
writer leaves at worst an unlisted shard, which `recover()` deletes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from vllm_specplug.extraction.storage import (remove_partial_files,
                                              save_safetensors_atomic,
                                              write_json_atomic)

DATASET_FORMAT = "vllm-specplug-hidden-states/1"
INFO_FILE = "dataset.json"
MANIFEST_FILE = "manifest.jsonl"
SHARD_DIR = "shards"
KEYS = ("input_ids", "hidden_states", "loss_mask")


@dataclass
class Sample:
    sample_id: str
    source_line: int
    input_ids: torch.Tensor      # [T] int64
    hidden_states: torch.Tensor  # [T, L, H] model dtype
    loss_mask: torch.Tensor      # [T] uint8


@dataclass(frozen=True)
class SampleRecord:
    sample_id: str
    source_line: int
    num_tokens: int
    shard: str
    offset: int


@dataclass(frozen=True)
class DatasetInfo:
    model: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    num_hidden_layers: int
    format: str = DATASET_FORMAT

    @classmethod
    def load(cls, root: str | os.PathLike) -> "DatasetInfo":
        path = Path(root) / INFO_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path}: not a vllm-specplug dataset "
                                    f"(no {INFO_FILE}); create it with "
                                    "`vllm-specplug extract`")
        data = json.loads(path.read_text())
        if data.get("format") != DATASET_FORMAT:
            raise ValueError(f"{path}: format {data.get('format')!r}, "
                             f"this version reads {DATASET_FORMAT!r}")
        return cls(**data)

    def save(self, root: str | os.PathLike) -> None:
        write_json_atomic(asdict(self), Path(root) / INFO_FILE)


def read_manifest(root: str | os.PathLike) -> list[SampleRecord]:
    """Complete lines only: a line cut short by a kill is ignored."""
    path = Path(root) / MANIFEST_FILE
    if not path.exists():
        return []
    records, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        if not line.endswith("\n"):
            break
        record = _parse_record(path, number, line)
        if record.sample_id not in seen:
            seen.add(record.sample_id)
            records.append(record)
    return records


def _parse_record(path: Path, number: int, line: str) -> SampleRecord:
    try:
        return SampleRecord(**json.loads(line))
    except (json.JSONDecodeError, TypeError) as error:
        raise ValueError(
            f"{path}:{number}: corrupt manifest line ({error}); the lines after a "
            "kill are dropped automatically, this one is complete but unreadable: "
            "fix or delete it, and its samples are extracted again") from error


def recover(root: str | os.PathLike) -> list[SampleRecord]:
    """Make a directory left by a killed writer consistent; return its records.

    Removes temporary files, a cut-short last manifest line and shards the
    manifest does not list (their samples are extracted again).
    """
    root = Path(root)
    remove_partial_files(root)
    records = read_manifest(root)
    manifest = root / MANIFEST_FILE
    if manifest.exists():
        text = "".join(json.dumps(asdict(r)) + "\n" for r in records)
        if manifest.read_text() != text:
            manifest.write_text(text)
    listed = {r.shard for r in records}
    for shard in sorted((root / SHARD_DIR).glob("*.safetensors")):
        if f"{SHARD_DIR}/{shard.name}" not in listed:
            shard.unlink()
    return records


def next_shard_index(root: str | os.PathLike) -> int:
    names = [p.stem for p in (Path(root) / SHARD_DIR).glob("shard-*.safetensors")]
    return 1 + max((int(n.split("-")[1]) for n in names), default=-1)


def write_shard(root: str | os.PathLike, index: int,
                samples: list[Sample]) -> list[SampleRecord]:
    """Write one shard atomically, then append its samples to the manifest."""
    shard = f"{SHARD_DIR}/shard-{index:05d}.safetensors"
    offsets = torch.tensor([0] + [s.input_ids.numel() for s in samples]).cumsum(0)
    tensors = {key: torch.cat([getattr(s, key) for s in samples]) for key in KEYS}
    save_safetensors_atomic(tensors, Path(root) / shard)
    records = [SampleRecord(s.sample_id, s.source_line, s.input_ids.numel(), shard,
                            int(offsets[i])) for i, s in enumerate(samples)]
    with open(Path(root) / MANIFEST_FILE, "a") as handle:
        handle.write("".join(json.dumps(asdict(r)) + "\n" for r in records))
        handle.flush()
        os.fsync(handle.fileno())
    return records


class HiddenStatesDataset(torch.utils.data.Dataset):
    """Per-sample tensors read lazily from the shards (slices, not whole files).

    Item: {"input_ids": [T] int64, "hidden_states": [T, L, H],
    "loss_mask": [T] uint8, "sample_id": str}.
    """

    def __init__(self, root: str | os.PathLike, sample_ids: list[str] | None = None):
        self.root = Path(root)
        self.info = DatasetInfo.load(self.root)
        records = read_manifest(self.root)
        if sample_ids is not None:
            wanted = set(sample_ids)
            records = [r for r in records if r.sample_id in wanted]
        self.records = records
        self._handles: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.records)

    def _open(self, shard: str):
        if shard not in self._handles:
            if len(self._handles) >= 8:   # bound open files on big datasets
                self._handles.pop(next(iter(self._handles)))
            self._handles[shard] = safe_open(str(self.root / shard), framework="pt")
        return self._handles[shard]

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        handle = self._open(record.shard)
        rows = slice(record.offset, record.offset + record.num_tokens)
        item = {key: handle.get_slice(key)[rows] for key in KEYS}
        item["sample_id"] = record.sample_id
        return item

    def __getstate__(self):
        # DataLoader workers reopen the shards themselves.
        return {**self.__dict__, "_handles": {}}
