"""Paths inside a storage directory and writes that readers never see half done."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

# A partly written file carries this infix until it is renamed into place.
TMP_INFIX = ".tmp-"


class StoragePathError(ValueError):
    pass


def resolve_inside(storage_dir: str | os.PathLike, relative: str) -> Path:
    """`storage_dir / relative`, refusing anything that would leave the directory.

    Absolute paths, `..` components and symlinks pointing outside are refused.
    """
    root = Path(storage_dir).resolve()
    if not relative or os.path.isabs(relative):
        raise StoragePathError(
            f"hidden_states_path {relative!r} must be a non-empty path relative to "
            f"the storage directory {str(root)!r}")
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise StoragePathError(
            f"hidden_states_path {relative!r} leaves the storage directory "
            f"{str(root)!r}; give a path inside it")
    return target


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                            metadata: dict[str, str] | None = None) -> None:
    """Write to a temporary name in the same directory, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_INFIX}{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata=metadata)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def write_json_atomic(obj, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TMP_INFIX}{os.getpid()}")
    with open(tmp, "w") as handle:
        json.dump(obj, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def remove_partial_files(directory: str | os.PathLike) -> list[Path]:
    """Delete leftovers of writes that were killed before their rename."""
    removed = [p for p in Path(directory).rglob(f"*{TMP_INFIX}*") if p.is_file()]
    for path in removed:
        path.unlink()
    return removed
