"""A regular (non-editable) install holds every module of the source tree.

The editable install that development and CI use resolves a sub-package
without `__init__.py` through the source directory, so a missing one only
shows in a real install (it did: `verification` and `bench` were absent from
the wheel the GPU host installed). Build the wheel and compare.
"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_modules() -> set[str]:
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "vllm_specplug").rglob("*.py")}
    modules |= {"vllm_specplug/kernels/" + str(p.relative_to(ROOT / "kernels"))
                for p in (ROOT / "kernels").rglob("*.py")}
    return {m for m in modules if "__pycache__" not in m}


def test_wheel_holds_every_module(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("vllm_specplug-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        packed = {name for name in archive.namelist() if name.endswith(".py")}
    missing = sorted(source_modules() - packed)
    assert not missing, f"not in the wheel (a package without __init__.py?): {missing}"


def test_kernels_import_from_a_source_checkout(tmp_path):
    """Run from a checkout (no install, checkout first on sys.path, no site
    packages), `vllm_specplug.kernels` still resolves to the top-level folder."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for folder in ("vllm_specplug", "kernels"):
        shutil.copytree(root / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import importlib.util, sys; sys.path.insert(0, '.'); "
            "import vllm_specplug.kernels; "
            "print(importlib.util.find_spec('vllm_specplug.kernels.ngram_match').origin)")
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "kernels" / "ngram_match.py")
