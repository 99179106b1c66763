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
writer leaves at worst an unlisted shard, which `repair.recover()` deletes. Damaged
input gives the named errors of `errors.py`; `repair.recover()` (run by `extract`)
sets damaged shards and manifest lines aside (repair.py).
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from vllm_specplug.extraction.errors import (RERUN_EXTRACT, DatasetFormatError,
                                             DatasetInfoError, DatasetNotFoundError,
                                             ManifestError, ShardError)
from vllm_specplug.extraction.shards import check_shard
from vllm_specplug.extraction.storage import (append_durable, save_safetensors_atomic,
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
            if (Path(root) / MANIFEST_FILE).exists():
                raise DatasetNotFoundError(
                    f"{path}: missing, though {MANIFEST_FILE} is there; re-run "
                    "`vllm-specplug extract` with the same arguments: it writes it "
                    "again, checks the shards against it and keeps every sample")
            raise DatasetNotFoundError(f"{path}: not a vllm-specplug dataset "
                                       f"(no {INFO_FILE}); create it with "
                                       "`vllm-specplug extract`")
        try:
            data = json.loads(path.read_text())
            version = data.get("format", DATASET_FORMAT) if isinstance(data, dict) \
                else DATASET_FORMAT
            if version != DATASET_FORMAT:
                raise DatasetFormatError(
                    f"{path}: format {version!r}, this version reads "
                    f"{DATASET_FORMAT!r}; use the vllm-specplug version that wrote it")
            info = cls(**data)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as error:
            raise DatasetInfoError(
                f"{path}: unreadable ({error}); re-run `vllm-specplug extract` with "
                "the same arguments: it sets this file aside, writes it again and "
                "checks the shards against it") from error
        _check_info_fields(path, info)
        return info

    def save(self, root: str | os.PathLike) -> None:
        write_json_atomic(asdict(self), Path(root) / INFO_FILE)


def _check_info_fields(path: Path, info: DatasetInfo) -> None:
    ok = (isinstance(info.layer_ids, list) and info.layer_ids
          and all(type(i) is int for i in info.layer_ids)
          and type(info.hidden_size) is int and info.hidden_size > 0
          and type(info.num_hidden_layers) is int and isinstance(info.dtype, str))
    if not ok:
        raise DatasetInfoError(
            f"{path}: fields have wrong types or values ({asdict(info)}); re-run "
            "`vllm-specplug extract` with the same arguments: it writes it again")


RECORD_FIELDS = {"sample_id": str, "source_line": int, "num_tokens": int,
                 "shard": str, "offset": int}
SHARD_NAME = re.compile(rf"{SHARD_DIR}/[A-Za-z0-9._-]+\.safetensors")


def _parse_record(text: str) -> SampleRecord:
    """One manifest line; ValueError (JSONDecodeError included) saying why not."""
    data = json.loads(text)
    if not isinstance(data, dict) or set(data) != set(RECORD_FIELDS):
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"fields {keys}, expected {sorted(RECORD_FIELDS)}")
    for name, kind in RECORD_FIELDS.items():
        if type(data[name]) is not kind:
            raise ValueError(f"{name} {data[name]!r} is not {kind.__name__}")
    if data["num_tokens"] < 1 or data["offset"] < 0:
        raise ValueError("num_tokens must be >= 1 and offset >= 0")
    if not SHARD_NAME.fullmatch(data["shard"]):
        raise ValueError(f"shard {data['shard']!r} is not {SHARD_DIR}/NAME.safetensors")
    return SampleRecord(**data)


def scan_manifest(root: str | os.PathLike):
    """([(line number, record)], [(line number, why unusable)]): complete lines
    only (a line cut short by a kill is ignored), first record per sample_id."""
    path = Path(root) / MANIFEST_FILE
    if not path.exists():
        return [], []
    good, bad, seen = [], [], set()
    # The piece after the last newline is empty, or a line cut short by a kill.
    for number, line in enumerate(path.read_bytes().split(b"\n")[:-1], 1):
        try:
            record = _parse_record(line.decode())    # UnicodeDecodeError too
        except ValueError as error:
            bad.append((number, str(error)))
            continue
        if record.sample_id not in seen:
            seen.add(record.sample_id)
            good.append((number, record))
    return good, bad


def manifest_error(root, number: int, problem: str) -> ManifestError:
    return ManifestError(f"{Path(root) / MANIFEST_FILE}:{number}: {problem}; "
                         f"{RERUN_EXTRACT}")


def read_manifest_lines(root: str | os.PathLike) -> list[tuple[int, SampleRecord]]:
    """[(line number, record)]: complete lines only (a line cut short by a kill
    is ignored); an unusable complete line raises ManifestError naming it."""
    good, bad = scan_manifest(root)
    if bad:
        number, problem = bad[0]
        raise manifest_error(root, number, f"corrupt manifest line ({problem})")
    return good


def read_manifest(root: str | os.PathLike) -> list[SampleRecord]:
    return [record for _, record in read_manifest_lines(root)]


def next_shard_index(root: str | os.PathLike) -> int:
    names = [p.stem for p in (Path(root) / SHARD_DIR).glob("shard-*.safetensors")]
    return 1 + max((int(n.split("-")[1]) for n in names), default=-1)


def write_shard(root: str | os.PathLike, index: int,
                samples: list[Sample]) -> list[SampleRecord]:
    """Write one shard atomically, then append its samples to the manifest.
    A failed append leaves the manifest as it was and removes the shard."""
    shard = f"{SHARD_DIR}/shard-{index:05d}.safetensors"
    offsets = torch.tensor([0] + [s.input_ids.numel() for s in samples]).cumsum(0)
    tensors = {key: torch.cat([getattr(s, key) for s in samples]) for key in KEYS}
    save_safetensors_atomic(tensors, Path(root) / shard)
    records = [SampleRecord(s.sample_id, s.source_line, s.input_ids.numel(), shard,
                            int(offsets[i])) for i, s in enumerate(samples)]
    lines = "".join(json.dumps(asdict(r)) + "\n" for r in records)
    try:
        append_durable(Path(root) / MANIFEST_FILE, lines.encode())
    except OSError:
        (Path(root) / shard).unlink(missing_ok=True)   # unlisted: frees the space
        raise
    return records


def check_records(root: Path, info: DatasetInfo, numbered) -> None:
    """Eager checks of the shards that `numbered` [(line, record)] use: each
    header against its size and dataset.json, each record inside its shard."""
    rows: dict[str, int] = {}
    for number, record in numbered:
        if record.shard not in rows:
            if not (root / record.shard).exists():
                raise ShardError(f"{root / record.shard}: missing (listed by "
                                 f"{MANIFEST_FILE}:{number}); {RERUN_EXTRACT}")
            rows[record.shard] = check_shard(root / record.shard, info)
        if record.offset + record.num_tokens > rows[record.shard]:
            raise manifest_error(root, number, (
                f"rows [{record.offset}, {record.offset + record.num_tokens}) point "
                f"past the end of {record.shard} ({rows[record.shard]} rows)"))


class HiddenStatesDataset(torch.utils.data.Dataset):
    """Per-sample tensors read lazily from the shards (slices, not whole files).

    Item: {"input_ids": [T] int64, "hidden_states": [T, L, H],
    "loss_mask": [T] uint8, "sample_id": str}. Opening checks dataset.json, every
    manifest line and every shard header (not the tensor data): damage raises a
    DatasetError at once, not minutes into training. Each item's values are
    checked as it is read.
    """

    def __init__(self, root: str | os.PathLike, sample_ids: list[str] | None = None):
        self.root = Path(root)
        self.info = DatasetInfo.load(self.root)
        numbered = read_manifest_lines(self.root)
        if sample_ids is not None:
            wanted = set(sample_ids)
            numbered = [(n, r) for n, r in numbered if r.sample_id in wanted]
        check_records(self.root, self.info, numbered)
        self._lines = {record.sample_id: number for number, record in numbered}
        self.records = [record for _, record in numbered]
        self._handles: dict[str, object] = {}

    def subset(self, sample_ids: list[str]) -> "HiddenStatesDataset":
        """The same dataset restricted to `sample_ids`, without checking again."""
        wanted = set(sample_ids)
        other = copy.copy(self)
        other.records = [r for r in self.records if r.sample_id in wanted]
        other._handles = {}
        return other

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
        rows = slice(record.offset, record.offset + record.num_tokens)
        try:
            handle = self._open(record.shard)
            item = {key: handle.get_slice(key)[rows] for key in KEYS}
        except (OSError, SafetensorError) as error:
            raise self._damaged(record, f"unreadable ({error})") from error
        problem = _value_problem(item)
        if problem:
            raise self._damaged(record, problem)
        item["sample_id"] = record.sample_id
        return item

    def _damaged(self, record: SampleRecord, problem: str) -> ShardError:
        return ShardError(
            f"{self.root / record.shard}: sample {record.sample_id} ({MANIFEST_FILE}:"
            f"{self._lines.get(record.sample_id, '?')}): {problem}; delete this shard "
            "and re-run `vllm-specplug extract` with the same arguments: its samples "
            "are extracted again, the rest are kept")

    def __getstate__(self):
        # DataLoader workers reopen the shards themselves.
        return {**self.__dict__, "_handles": {}}


def _value_problem(item: dict) -> str | None:
    """Bytes damaged inside the tensor data show up as impossible values."""
    if item["input_ids"].numel() and int(item["input_ids"].min()) < 0:
        return "negative token ids"
    if item["loss_mask"].numel() and int(item["loss_mask"].max()) > 1:
        return "loss_mask values other than 0 and 1"
    if not bool(torch.isfinite(item["hidden_states"]).all()):
        return "hidden_states hold NaN or inf (damaged bytes, or the target overflowed)"
    return None
