"""Run a patch when its vLLM module is first imported, not before.

The plugin's `register()` runs in every vLLM process; importing the model
runner just to patch it would add seconds to the API server and engine-core
start, which never use it. A post-import hook patches it in the processes
that do import it (the workers), at the moment they do.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

_PENDING: dict[str, list[Callable[[], object]]] = {}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        sys.meta_path.remove(self)  # find the real spec without recursing
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            for callback in _PENDING.pop(fullname, []):
                callback()

        spec.loader.exec_module = exec_then_patch
        return spec


_FINDER = _PostImportFinder()


def when_imported(module_name: str, callback: Callable[[], object]) -> str:
    """Call `callback` now if the module is loaded, else right after it loads."""
    if module_name in sys.modules:
        callback()
        return "now"
    _PENDING.setdefault(module_name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return "on import"
