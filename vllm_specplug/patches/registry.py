"""A small registry through which every monkey-patch of vLLM goes.

It logs each patch, refuses to patch the same attribute twice (two plugins or a
double registration would otherwise stack wrappers silently), and refuses to
patch a vLLM version the patch was not written for.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet

from vllm_specplug.version_gate import SUPPORTED_VLLM, check_vllm_version

logger = logging.getLogger("vllm_specplug.patches")


class PatchConflict(RuntimeError):
    """The attribute was already patched in this process."""


@dataclass(frozen=True)
class PatchRecord:
    target: str  # "module.Class.attr"
    reason: str
    original: Any = field(repr=False)
    pid: int


def _target_name(owner: Any, attr: str) -> str:
    module = getattr(owner, "__module__", None)
    qualname = getattr(owner, "__qualname__", None)
    if qualname is None:  # a module object
        return f"{owner.__name__}.{attr}"
    return f"{module}.{qualname}.{attr}"


class PatchRegistry:
    def __init__(self) -> None:
        self._records: dict[str, PatchRecord] = {}

    def apply(self, owner: Any, attr: str, replacement: Any, *, reason: str,
              versions: SpecifierSet = SUPPORTED_VLLM,
              vllm_version: str | None = None) -> PatchRecord:
        """Set `owner.attr = replacement` once, after checking the vLLM version."""
        target = _target_name(owner, attr)
        if target in self._records:
            raise PatchConflict(f"{target} is already patched "
                                f"({self._records[target].reason}); refusing "
                                "to patch it twice")
        version = check_vllm_version(vllm_version)
        if version.base_version not in versions:
            raise PatchConflict(f"patch of {target} was written for vllm"
                                f"{versions}, found {version}")
        if not hasattr(owner, attr):
            raise PatchConflict(f"{target} does not exist in vLLM {version}; "
                                "the patch is out of date")
        record = PatchRecord(target, reason, getattr(owner, attr), os.getpid())
        setattr(owner, attr, replacement)
        self._records[target] = record
        logger.info("vllm-specplug patched %s: %s", target, reason)
        return record

    def revert(self, owner: Any, attr: str) -> None:
        record = self._records.pop(_target_name(owner, attr))
        setattr(owner, attr, record.original)

    def applied(self) -> list[PatchRecord]:
        return list(self._records.values())


patch_registry = PatchRegistry()
