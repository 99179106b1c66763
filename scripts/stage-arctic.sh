#!/usr/bin/env bash
# Build arctic-inference 0.3.0 (suffix decoding) as a cp312 wheel for the GPU
# host (Python 3.12, no package index), next to the staged vLLM:
#   bash scripts/stage-arctic.sh [.gpu]      -> .gpu/whl/arctic_inference-0.3.0-cp312-*.whl
# Its setup imports torch and builds one C++ extension with nanobind, CMake and
# Ninja; only that extension (suffix_decoding._C, CPU code) is built. Built
# here against glibc 2.36 / libstdc++ 12, it loads on the host's newer ones.
set -euo pipefail
OUT="${1:-.gpu}"
PY312="$(command -v python3.12 || true)"
[ -n "$PY312" ] || { echo "[stage-arctic] python3.12 is needed to build a cp312 wheel"; exit 1; }
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT/whl" .git/info
grep -qx "/$OUT/" .git/info/exclude 2>/dev/null || echo "/$OUT/" >> .git/info/exclude
"$PY312" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "nanobind==2.9.2" grpcio-tools "protobuf==5.29.6" \
    setuptools wheel ninja numpy torch 2>&1 | grep -v "is ignored" || true
"$WORK/venv/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
    -d "$WORK/src" arctic-inference==0.3.0 2>&1 | grep -v "is ignored" || true
tar -C "$WORK/src" -xzf "$WORK"/src/arctic_inference-0.3.0.tar.gz
# CMake's FindPython would pick another interpreter than the one nanobind is in.
CMAKE_ARGS="-DPython_EXECUTABLE=$WORK/venv/bin/python" "$WORK/venv/bin/pip" wheel -q \
    --no-deps --no-build-isolation -w "$OUT/whl" "$WORK/src/arctic_inference-0.3.0" \
    2>&1 | grep -v "is ignored" || true
ls -la "$OUT"/whl/arctic_inference-0.3.0-cp312-*.whl
