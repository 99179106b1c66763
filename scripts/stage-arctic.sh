#!/usr/bin/env bash
# Build arctic-inference 0.3.0 (suffix decoding) as a cp312 wheel for the GPU
# host (Python 3.12, no package index), next to the staged vLLM:
#   bash scripts/stage-arctic.sh [.gpu]      -> .gpu/whl/arctic_inference-0.3.0-cp312-*.whl
# Its setup imports torch and builds one C++ extension with nanobind, CMake and
# Ninja; only that extension (suffix_decoding._C, CPU code) is built. Built
# here against glibc 2.36 / libstdc++ 12, it loads on the host's newer ones.
set -euo pipefail
OUT="${1:-.gpu}"
# A Python 3.12 that really runs: $PYTHON312, python3.12 on PATH (a pyenv shim
# for a version that is not active exits 127), or an installed pyenv version.
find_python312() {
    local candidate
    for candidate in ${PYTHON312:-} "$(command -v python3.12 || true)" \
                     "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
        [ -n "$candidate" ] && [ -x "$candidate" ] || continue
        "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
            && { echo "$candidate"; return 0; }
    done
    return 1
}
PY312="$(find_python312)" || { echo "[stage-arctic] no working Python 3.12: install one" \
    "(e.g. 'pyenv install 3.12') or set PYTHON312=/path/to/python3.12"; exit 1; }
echo "[stage-arctic] building with $PY312"
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
