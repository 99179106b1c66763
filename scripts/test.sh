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
exec .venv/bin/python -m pytest tests -q -rs "$@"
