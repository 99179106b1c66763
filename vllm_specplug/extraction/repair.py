"""What `vllm-specplug extract` does to an existing dataset directory before it
resumes (docs/extraction.md, "Bad input"):

- temporary files of killed writes: deleted; a manifest line cut short: dropped;
- complete manifest lines that are unusable (not JSON, wrong fields, rows past
  the end of their shard, shard missing or damaged): dropped, after a copy of
  the manifest goes to `DIR/quarantine/`; their samples are extracted again;
- shards failing the header checks (shards.py): moved to `DIR/quarantine/`;
- shards no line lists: deleted (a kill between a shard's rename and its lines),
  or moved to `DIR/quarantine/` when lines were dropped (they may be theirs);
- dataset.json missing or unreadable: set aside and written again from the
  run's arguments, once every readable shard agrees with it.

A readable shard that disagrees with dataset.json (other layers, hidden size,
dtype) raises ShardMismatchError: nothing is moved on a guess.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from vllm_specplug.extraction import dataset as ds
from vllm_specplug.extraction.errors import (DatasetFormatError, DatasetInfoError,
                                             DatasetNotFoundError, OutputWriteError,
                                             ShardError, ShardMismatchError)
from vllm_specplug.extraction.shards import check_shard, read_header
from vllm_specplug.extraction.storage import remove_partial_files, write_text_atomic

QUARANTINE_DIR = "quarantine"


def quarantine(root: Path, path: Path) -> Path:
    """Move `path` into DIR/quarantine/ (a rename: needs no free space)."""
    target = root / QUARANTINE_DIR / path.name
    count = 0
    while target.exists():
        count += 1
        target = root / QUARANTINE_DIR / f"{path.name}.{count}"
    try:
        target.parent.mkdir(exist_ok=True)
        os.replace(path, target)
    except OSError as error:
        raise OutputWriteError.wrap(error, target) from error
    return target


def recover(root: str | os.PathLike, notes: list[str] | None = None
            ) -> list[ds.SampleRecord]:
    """Make a directory left by a killed writer, a full disk or damage
    consistent; return its records. Repairs are appended to `notes`."""
    return recover_dataset(Path(root), notes if notes is not None else [])


def recover_dataset(root: Path, notes: list[str]) -> list[ds.SampleRecord]:
    remove_partial_files(root)
    info = _info_or_none(root)
    good, bad = ds.scan_manifest(root)
    rows, damaged = _check_shards(root, info, {r.shard for _, r in good})
    keep = []
    for number, record in good:
        problem = _record_problem(record, rows, damaged)
        if problem:
            bad.append((number, problem))
        else:
            keep.append(record)
    for shard, reason in sorted(damaged.items()):
        moved = quarantine(root, root / shard)
        notes.append(f"moved {shard} to {moved.relative_to(root)}: {reason}")
    _rewrite_manifest(root, keep, sorted(bad), notes)
    _drop_unlisted(root, {r.shard for r in keep}, bool(bad), notes)
    return keep


def _info_or_none(root: Path):
    try:
        return ds.DatasetInfo.load(root)
    except DatasetInfoError:
        return None


def _check_shards(root: Path, info, shards: set[str]):
    """({shard: rows} of intact shards, {shard: reason} of damaged ones);
    missing shards are in neither."""
    rows, damaged = {}, {}
    for shard in sorted(shards):
        if not (root / shard).exists():
            continue
        try:
            if info is not None:
                rows[shard] = check_shard(root / shard, info)
            else:
                rows[shard] = read_header(root / shard)["input_ids"]["shape"][0]
        except ShardMismatchError:
            raise
        except (ShardError, KeyError, IndexError) as error:
            damaged[shard] = getattr(error, "problem", str(error))
    return rows, damaged


def _record_problem(record: ds.SampleRecord, rows: dict, damaged: dict) -> str | None:
    if record.shard in damaged:
        return f"{record.shard} was damaged"
    if record.shard not in rows:
        return f"{record.shard} is missing"
    if record.offset + record.num_tokens > rows[record.shard]:
        return (f"rows [{record.offset}, {record.offset + record.num_tokens}) past the "
                f"end of {record.shard} ({rows[record.shard]} rows)")
    return None


def _rewrite_manifest(root: Path, keep, bad, notes: list[str]) -> None:
    manifest = root / ds.MANIFEST_FILE
    if not manifest.exists():
        return
    text = "".join(json.dumps(asdict(r)) + "\n" for r in keep)
    if manifest.read_bytes() == text.encode():
        return
    if bad:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        copy = root / QUARANTINE_DIR / f"{ds.MANIFEST_FILE}.{stamp}"
        try:
            copy.parent.mkdir(exist_ok=True)
            shutil.copyfile(manifest, copy)
        except OSError as error:
            raise OutputWriteError.wrap(error, copy) from error
        notes.extend(f"{ds.MANIFEST_FILE}:{number}: line dropped ({problem}); its "
                     "sample is extracted again" for number, problem in bad)
        notes.append(f"the previous manifest is kept as {copy.relative_to(root)}")
    write_text_atomic(text, manifest)   # atomic: a failure keeps the old one


def _drop_unlisted(root: Path, listed: set[str], keep_aside: bool,
                   notes: list[str]) -> None:
    for shard in sorted((root / ds.SHARD_DIR).glob("*.safetensors")):
        name = f"{ds.SHARD_DIR}/{shard.name}"
        if name in listed:
            continue
        if keep_aside:
            moved = quarantine(root, shard)
            notes.append(f"moved {name}, which no manifest line lists, to "
                         f"{moved.relative_to(root)}")
        else:
            shard.unlink()


def ensure_info(out: Path, info: ds.DatasetInfo, notes: list[str]) -> None:
    """dataset.json for this run: written for a new directory; set aside and
    written again when missing or unreadable, once the shards agree with it;
    another model or other layers are refused."""
    try:
        existing = ds.DatasetInfo.load(out)
    except DatasetFormatError:
        raise
    except (DatasetNotFoundError, DatasetInfoError):
        existing = None
    if existing is not None:
        if (existing.model, existing.layer_ids) != (info.model, info.layer_ids):
            raise ValueError(
                f"--out {out} holds a dataset of {existing.model} layers "
                f"{existing.layer_ids}; this run asks for {info.model} layers "
                f"{info.layer_ids}. Use another --out or the same --layers")
        return
    for shard in sorted((out / ds.SHARD_DIR).glob("*.safetensors")):
        try:
            check_shard(shard, info)
        except ShardMismatchError:
            raise
        except ShardError:
            pass                  # damaged: recover_dataset() sets it aside
    if (out / ds.INFO_FILE).exists():
        moved = quarantine(out, out / ds.INFO_FILE)
        notes.append(f"{ds.INFO_FILE} was unreadable: moved to "
                     f"{moved.relative_to(out)} and written again")
    elif (out / ds.MANIFEST_FILE).exists():
        notes.append(f"{ds.INFO_FILE} was missing: written again")
    info.save(out)
