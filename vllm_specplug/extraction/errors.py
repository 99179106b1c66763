"""Named errors for bad input and failed writes, shared by `extract` and `train-eagle3`.

Each message names the file (and the manifest line) and says what to do
(docs/extraction.md and docs/training.md, "Bad input").

    DatasetError (ValueError)        a dataset directory that cannot be read as written
        DatasetInfoError             dataset.json unreadable
            DatasetNotFoundError     no dataset.json (also a FileNotFoundError)
            DatasetFormatError       another format version: never rewritten
        ManifestError                a complete manifest line that is unusable
        ShardError                   a shard missing, cut short, or not a safetensors file
            ShardMismatchError       a readable shard that disagrees with dataset.json
    OutputDirError (ValueError)      an output directory refused before any work
    OutputWriteError (OSError)       a write that failed (disk full, read-only, ...)
"""
from __future__ import annotations

import errno as errno_module
import os
import re

# What to do about a damaged dataset: `extract` repairs it (repair.py).
RERUN_EXTRACT = ("re-run `vllm-specplug extract` with the same arguments: it moves "
                 "the damaged part to DIR/quarantine/, keeps every intact sample and "
                 "extracts the others again")


class DatasetError(ValueError):
    """A dataset directory that cannot be read as `vllm-specplug extract` wrote it."""


class DatasetInfoError(DatasetError):
    """dataset.json missing or unreadable."""


class DatasetNotFoundError(DatasetInfoError, FileNotFoundError):
    """No dataset.json: not a dataset directory."""


class DatasetFormatError(DatasetInfoError):
    """dataset.json of another format version."""


class ManifestError(DatasetError):
    """A complete manifest line that is not a usable record."""


class ShardError(DatasetError):
    """A shard that is missing, cut short, or not a safetensors file.
    `problem`: the reason alone, without the path and the fix."""

    def __init__(self, message: str, problem: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem or message


class ShardMismatchError(ShardError):
    """A readable shard whose tensors disagree with dataset.json (other layers,
    hidden size or dtype): never set aside automatically."""


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
