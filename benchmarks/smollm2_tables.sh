#!/usr/bin/env bash
# The real-target issue's tables on CPU (issue 25): SmolLM2-135M-Instruct in
# fp32 with the tables' EAGLE-3 head (`build-model smollm2-eagle3-small`),
# MT-Bench (both turns) and HumanEval on the same engines, batch 1 / 16 / 64,
# 3 interleaved repeats.
#   bash benchmarks/smollm2_tables.sh OUT [MAX_TOKENS]
# BATCH_SIZES (default "1 16 64") and LIMITS (default "1=4 16=16 64=64",
# prompts run at each batch size) trim it; HEAD=DIR uses a head already built.
# Two runs, each against its own no-speculation rows:
#   OUT/eagle: vLLM's eagle3 at K 3/5/7, our chain and trees of 8-64 nodes, our
#              suffix and hybrid and vLLM's suffix, one engine alive at a time
#              (`--order restart`, engines in this process: seconds to start);
#   OUT/ngram: vLLM's ngram beside ours (vLLM's loads numba, after which no
#              engine may start in this process: `--order interleaved`).
set -euo pipefail
OUT=${1:?usage: smollm2_tables.sh OUT [MAX_TOKENS]}
MAX_TOKENS=${2:-32}
source "$(dirname "$0")/smollm2_specs.sh"
# the trees' draft_temperature (smollm2_specs.sh): SmolLM2's heads rank their
# nodes better at 1.0 than at the tiny head's 0.25 (docs/results/smollm2_tree_shapes_cpu_head)
: "${TREE_T:=1.0}"
CLI=${CLI:-.venv/bin/vllm-specplug}
MODEL=$($CLI build-model smollm2 --dtype float32 | tail -1)
HEAD=${HEAD:-$($CLI build-model smollm2-eagle3-small | tail -1)}
read -r -a BATCHES <<< "${BATCH_SIZES:-1 16 64}"
LIMIT_ARGS=()
for limit in ${LIMITS:-1=4 16=16 64=64}; do LIMIT_ARGS+=(--limit-prompts "$limit"); done
COMMON=(--model "$MODEL" --prompts mt-bench --prompts humaneval --batch-sizes "${BATCHES[@]}"
        "${LIMIT_ARGS[@]}" --repeats 3
        --max-tokens "$MAX_TOKENS" --warmup-runs 0 --dtype float32  # "auto" would run bf16
        --engine-args '{"enforce_eager": true}')
mapfile -t EAGLE < <(full_specs full "$HEAD"; full_specs free "$HEAD")
mapfile -t NGRAM < <(full_specs ngram "$HEAD")
VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
  $CLI bench offline "${COMMON[@]}" "${EAGLE[@]}" --order restart --out "$OUT/eagle"
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
  $CLI bench offline "${COMMON[@]}" "${NGRAM[@]}" --out "$OUT/ngram"
