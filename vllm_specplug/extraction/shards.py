"""Cheap checks of a shard: its safetensors header against its size and dataset.json.

Only the header is read (8 bytes of length, then the JSON header), never the
tensors, so checking every shard when a dataset opens costs milliseconds. It
finds shards cut short, grown, overwritten with garbage, or holding other
tensors; bytes changed inside the tensor data are not seen here (no checksums;
the reader checks each sample's values when it reads them).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from vllm_specplug.extraction.errors import (RERUN_EXTRACT, ShardError,
                                             ShardMismatchError)

MAX_HEADER_BYTES = 100 * 1024 * 1024   # safetensors' own limit
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
              "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
TORCH_TO_CODE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16",
                 "float64": "F64"}


def _bad(path: Path, problem: str) -> ShardError:
    return ShardError(f"{path}: {problem}; {RERUN_EXTRACT}", problem)


def read_header(path: str | Path) -> dict:
    """The safetensors header of `path`: {name: {dtype, shape, data_offsets}},
    checked entry by entry and against the file's size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little") if size >= 8 else -1
            if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
                raise _bad(path, f"not a safetensors file (header length field "
                           f"{length}, file {size} bytes): cut short or overwritten")
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise _bad(path, "missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _bad(path, f"safetensors header is not JSON ({error}): "
                   "overwritten with other bytes") from error
    except OSError as error:
        raise _bad(path, f"cannot read it ({error.strerror})") from error
    if not isinstance(header, dict):
        raise _bad(path, "safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    end = max([_entry_end(path, name, entry) for name, entry in header.items()],
              default=0)
    expected = 8 + length + end
    if size != expected:
        how = "cut short" if size < expected else "bytes appended"
        raise _bad(path, f"file is {size} bytes, its header describes {expected}: {how}")
    return header


def _entry_end(path: Path, name: str, entry) -> int:
    try:
        begin, end = (int(x) for x in entry["data_offsets"])
        count = math.prod(int(d) for d in entry["shape"])
        item = ITEM_BYTES[entry["dtype"]]
    except (TypeError, KeyError, ValueError):
        raise _bad(path, f"header entry {name!r} is malformed: {entry!r}") from None
    if begin < 0 or end - begin != count * item:
        raise _bad(path, f"header entry {name!r}: {end - begin} bytes for shape "
                   f"{entry['shape']} of {entry['dtype']}")
    return end


def check_shard(path: str | Path, info) -> int:
    """Rows N of a shard holding input_ids [N] I64, loss_mask [N] U8 and
    hidden_states [N, L, H] in dataset.json's layers, hidden size and dtype."""
    path = Path(path)
    header = read_header(path)
    missing = [k for k in ("input_ids", "hidden_states", "loss_mask") if k not in header]
    if missing:
        raise _bad(path, f"tensors {missing} missing (has {sorted(header)})")
    ids, mask, hidden = (header[k] for k in ("input_ids", "loss_mask", "hidden_states"))
    rows = ids["shape"][0] if len(ids["shape"]) == 1 else -1
    if (ids["dtype"], mask["dtype"], mask["shape"]) != ("I64", "U8", [rows]) \
            or len(hidden["shape"]) != 3 or hidden["shape"][0] != rows:
        raise _bad(path, f"tensors do not form a dataset shard: input_ids "
                   f"{ids['dtype']} {ids['shape']}, loss_mask {mask['dtype']} "
                   f"{mask['shape']}, hidden_states {hidden['shape']}")
    expected = [rows, len(info.layer_ids), info.hidden_size]
    dtype = TORCH_TO_CODE.get(info.dtype, hidden["dtype"])
    if hidden["shape"] != expected or hidden["dtype"] != dtype:
        raise ShardMismatchError(
            f"{path}: hidden_states is {hidden['dtype']} {hidden['shape']}, but "
            f"dataset.json (layers {info.layer_ids}, hidden size {info.hidden_size}, "
            f"{info.dtype}) implies {dtype} {expected}: written for another model or "
            "--layers? Extract into a new --out, or move this shard away if it does "
            "not belong here")
    return rows
