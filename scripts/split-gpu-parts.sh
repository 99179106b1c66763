#!/usr/bin/env bash
# Re-split the staged vLLM site (.gpu/p1, p2, ... from ../shared/gpu/stage-vllm.sh)
# into parts that each fit one device call beside this checkout's tracked
# files: a call carries at most 64 MiB, tracked tree included, and the tree
# grows with docs/results (23.5 MB on 2026-11-29, when a 44 MB part no longer
# fit). Checks the parts against .gpu/vsite.sha256 before replacing them.
#
# Usage, from the project root:  bash scripts/split-gpu-parts.sh [OUT_DIR] [MARGIN_BYTES]
# Then one call per part (carry OUT_DIR/pN, `cp OUT_DIR/pN/* $HOME/stash/`),
# the last with unpack.sh, vsite.sha256, extra and whl and `host.sh install`
# (docs/gpu.md).
set -euo pipefail
OUT="${1:-.gpu}"
MARGIN="${2:-6000000}"  # room for the install call's small folders and growth
LIMIT=$((64 * 1024 * 1024))
tracked=$(git ls-files -z | xargs -0 cat | wc -c)
part=$((LIMIT - tracked - MARGIN))
[ "$part" -gt 4000000 ] || { echo "[split] the tracked tree ($tracked B) leaves no room"; exit 2; }
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
cat "$OUT"/p[0-9]*/vsite.part.* > "$WORK/vsite.tar.xz"
got=$(sha256sum "$WORK/vsite.tar.xz" | cut -c1-64)
[ "$got" = "$(cat "$OUT/vsite.sha256")" ] || { echo "[split] $OUT/p* do not match vsite.sha256"; exit 2; }
rm -rf "$OUT"/p[0-9]*
split -b "$part" -d -a 1 "$WORK/vsite.tar.xz" "$WORK/vsite.part."
i=1; for p in "$WORK"/vsite.part.*; do mkdir -p "$OUT/p$i"; mv "$p" "$OUT/p$i/"; i=$((i + 1)); done
echo "[split] tracked tree $tracked B: $((i - 1)) parts of at most $part B in $OUT/p1..p$((i - 1))"
