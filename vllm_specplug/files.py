"""Files that readers never see half written, and the errors of writing them.

Shared by every feature that writes (extraction, training, draft-head
checkpoints, model builds): a write goes to a temporary name in the same
directory, is fsynced and renamed into place; a failure is an
`OutputWriteError` that names the errno, the path and what to do.
"""
from __future__ import annotations

import errno as errno_module
import json
import os
import re
from contextlib import suppress
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

# A partly written file carries this infix until it is renamed into place.
TMP_INFIX = ".tmp-"


class OutputDirError(ValueError):
    """An output directory that cannot be written, found before any work."""


def errno_name(number: int | None) -> str:
    return errno_module.errorcode.get(number or -1, "I/O error")


def errno_in(text: str) -> int | None:
    """The errno inside a message: `[Errno 28]`, `os error 28` (safetensors) or a name."""
    match = re.search(r"\[Errno (\d+)\]|os error (\d+)", text)
    if match:
        return int(match.group(1) or match.group(2))
    for number, name in errno_module.errorcode.items():
        if re.search(rf"\b{name}\b", text):
            return number
    return None


class OutputWriteError(OSError):
    """A write that failed. `str()` names the errno, the path and what to do."""

    def __init__(self, number: int | None, path, detail: str,
                 fix: str = "free space there (or make it writable, or choose another "
                            "output directory) and re-run the same command: what is "
                            "already written is kept and the run resumes") -> None:
        super().__init__(number, detail)
        self.filename = str(path)
        self.message = f"cannot write {path}: {errno_name(number)} ({detail}); {fix}"

    def __str__(self) -> str:
        return self.message

    @classmethod
    def wrap(cls, error: BaseException, path) -> "OutputWriteError":
        if isinstance(error, OutputWriteError):
            return error
        if isinstance(error, OSError) and error.errno is not None:
            return cls(error.errno, path, error.strerror or str(error))
        text = str(error)
        number = errno_in(text)
        return cls(number, path, os.strerror(number) if number else text)


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
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
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
