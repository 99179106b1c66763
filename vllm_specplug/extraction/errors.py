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

The last two are shared by every feature that writes files and live in
`vllm_specplug/files.py`; they are named here too for extraction's readers.
"""
from __future__ import annotations

from vllm_specplug.files import OutputDirError, OutputWriteError, errno_in, errno_name

__all__ = ["RERUN_EXTRACT", "DatasetError", "DatasetInfoError", "DatasetNotFoundError",
           "DatasetFormatError", "ManifestError", "ShardError", "ShardMismatchError",
           "OutputDirError", "OutputWriteError", "errno_in", "errno_name"]

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
