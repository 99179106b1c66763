#!/usr/bin/env bash
# The README's test command: set up if needed, build the tiny model (cached),
# run the whole suite against real vLLM engines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
if [ $# -gt 0 ]; then   # the caller's selection, as given
  .venv/bin/vllm-specplug build-model tiny >/dev/null
  .venv/bin/vllm-specplug build-model tiny-eagle3 >/dev/null
  .venv/bin/vllm-specplug build-model tiny-mtp >/dev/null
  exec .venv/bin/python -m pytest -q -rs "$@"
fi
# Kernel tests in a pytest of their own: tests/kernels/conftest.py turns the
# Triton interpreter on as it is collected, and every @triton.jit imported
# after that (vLLM's too) would stay interpreted inside the engines the other
# tests run in the pytest process (tests/conftest.py, docs/testing.md).
# They need no model and run mostly on one core, so they run beside the
# model builds and the engine tests, at the lowest priority: they take the
# CPU time the builds and engines leave (process starts, imports, waits)
# instead of slowing the tiny model's training; docs/testing.md.
kernel_log=$(mktemp)
nice -n 19 .venv/bin/python -m pytest tests/kernels -q -rs -p no:cacheprovider > "$kernel_log" 2>&1 &
kernel_pid=$!
.venv/bin/vllm-specplug build-model tiny >/dev/null
.venv/bin/vllm-specplug build-model tiny-eagle3 >/dev/null
.venv/bin/vllm-specplug build-model tiny-mtp >/dev/null
.venv/bin/lint-imports --no-cache | tail -6   # the layer contracts
rc=0
.venv/bin/python -m pytest tests -q -rs --durations=25 --ignore=tests/kernels || rc=$?   # the slowest 25: where CI time goes
kernel_rc=0
wait "$kernel_pid" || kernel_rc=$?
echo "== tests/kernels (run beside the others) =="
cat "$kernel_log"
rm -f "$kernel_log"
[ "$kernel_rc" -eq 0 ] || { echo "tests/kernels failed (exit $kernel_rc)"; exit "$kernel_rc"; }
exit "$rc"
