"""vllm-specplug: an out-of-tree speculative-decoding plugin for vLLM.

Importing this package is cheap and imports nothing from vLLM: vLLM loads our
`register()` entry point in every process it starts.

`kernels/` (the `@triton.jit` code) sits at the top of the repository and is
installed as `vllm_specplug.kernels` (setup.py's `package_dir`). Run from a
source checkout, where the checkout comes first on `sys.path` and no install
mapped it, the same folder is mounted here, so `vllm_specplug.kernels` is
importable both ways (without it, on the H100, `specplug_ngram`'s device
drafter failed to import and the guard switched speculation off).
"""
import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _mount_source_kernels() -> None:
    here = _os.path.dirname(__file__)
    source = _os.path.join(_os.path.dirname(here), "kernels")
    name = f"{__name__}.kernels"
    if (name in _sys.modules or _os.path.isdir(_os.path.join(here, "kernels"))
            or not _os.path.isfile(_os.path.join(source, "__init__.py"))):
        return  # installed (or already mounted): the normal import finds it
    spec = _util.spec_from_file_location(name, _os.path.join(source, "__init__.py"),
                                         submodule_search_locations=[source])
    module = _util.module_from_spec(spec)
    _sys.modules[name] = module
    spec.loader.exec_module(module)


_mount_source_kernels()
