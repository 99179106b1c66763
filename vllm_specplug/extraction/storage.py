"""Paths inside a storage directory and writes that readers never see half done."""
from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from vllm_specplug.extraction.errors import (OutputDirError, OutputWriteError,
                                             errno_name)

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


def _write_atomic(path: str | os.PathLike, write) -> None:
    """`write(tmp)` to a temporary name in the same directory, fsync, rename.

    On failure the temporary file goes, `path` keeps its old content, and the
    error is an `OutputWriteError` naming the errno and `path`.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TMP_INFIX}{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except (OSError, SafetensorError) as error:
        raise OutputWriteError.wrap(error, path) from error
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                            metadata: dict[str, str] | None = None) -> None:
    """Write to a temporary name in the same directory, fsync, then rename."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    _write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def write_text_atomic(text: str, path: str | os.PathLike) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(obj, path: str | os.PathLike) -> None:
    write_text_atomic(json.dumps(obj, indent=2, sort_keys=True), path)


def append_durable(path: str | os.PathLike, data: bytes) -> None:
    """Append `data` and fsync. On failure the file is cut back to its old
    length (a reader never sees part of `data`) and OutputWriteError is raised."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as error:
        raise OutputWriteError.wrap(error, path) from error
    size = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as error:
        with suppress(OSError):
            os.ftruncate(fd, size)
        raise OutputWriteError.wrap(error, path) from error
    finally:
        os.close(fd)


def check_writable_dir(directory: str | os.PathLike, flag: str = "--out") -> None:
    """Create `directory` and write a probe file there, before any work."""
    directory = Path(directory)
    probe = directory / f".write-probe{TMP_INFIX}{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
    except OSError as error:
        raise OutputDirError(
            f"{flag} {directory}: cannot write there ({errno_name(error.errno)}: "
            f"{error.strerror}); choose a writable directory, or free space") from error
    finally:
        with suppress(OSError):
            probe.unlink(missing_ok=True)


def remove_partial_files(directory: str | os.PathLike) -> list[Path]:
    """Delete leftovers of writes that were killed before their rename."""
    removed = [p for p in Path(directory).rglob(f"*{TMP_INFIX}*") if p.is_file()]
    for path in removed:
        path.unlink()
    return removed
