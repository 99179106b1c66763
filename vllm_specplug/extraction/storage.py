"""Paths inside a storage directory; the atomic writes extraction uses (from
`vllm_specplug/files.py`, shared by every feature that writes files)."""
from __future__ import annotations

import os
from pathlib import Path

from vllm_specplug.files import (TMP_INFIX, append_durable, check_writable_dir,
                                 remove_partial_files, save_safetensors_atomic,
                                 write_json_atomic, write_text_atomic)

__all__ = ["StoragePathError", "resolve_inside", "TMP_INFIX", "append_durable",
           "check_writable_dir", "remove_partial_files", "save_safetensors_atomic",
           "write_json_atomic", "write_text_atomic"]


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
