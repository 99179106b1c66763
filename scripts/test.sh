#!/usr/bin/env bash
# The README's test command: set up if needed, build the tiny model (cached),
# run the whole suite against real vLLM engines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
.venv/bin/vllm-specplug build-model tiny >/dev/null
.venv/bin/vllm-specplug build-model tiny-eagle3 >/dev/null
.venv/bin/vllm-specplug build-model tiny-mtp >/dev/null
.venv/bin/lint-imports --no-cache | tail -6   # the layer contracts
if [ $# -gt 0 ]; then   # the caller's selection, as given
  exec .venv/bin/python -m pytest -q -rs "$@"
fi
# Kernel tests first, in a pytest of their own: tests/kernels/conftest.py turns
# the Triton interpreter on as it is collected, and every @triton.jit imported
# after that (vLLM's too) would stay interpreted inside the engines the other
# tests run in the pytest process (tests/conftest.py, docs/testing.md).
.venv/bin/python -m pytest tests/kernels -q -rs
exec .venv/bin/python -m pytest tests -q -rs --ignore=tests/kernels
