"""The GPU tests' environment. The lent GPU host's staged vLLM has no
flashinfer (docs/gpu.md), and vLLM's sampler there imports it unless
`VLLM_USE_FLASHINFER_SAMPLER=0`: a plain `python3 -m pytest tests/gpu` had
every engine test fail at set-up on `ModuleNotFoundError: flashinfer`
(2026-12-03; `benchmarks/gpu/host.sh` exports the variable). Where flashinfer
is installed nothing changes."""
import importlib.util
import os

if importlib.util.find_spec("flashinfer") is None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
