"""The repository's benchmark scripts (`benchmarks/*.py`, not a package) as
modules, for tests that call their functions."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """`benchmarks/<name>.py`, loaded once and registered in `sys.modules`
    (a script's dataclasses look their module up there)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
