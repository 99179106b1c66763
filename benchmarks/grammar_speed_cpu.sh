#!/usr/bin/env bash
# Issue 30, CPU: tokens/s of no speculation, vLLM's ngram and eagle3, our
# chain and trees (masked drafts, and the deep tree unmasked) on the tiny
# model, under benchmarks/json_schema.json and without it, 3 interleaved
# repeats at batch 1 (4 prompts one at a time), 16 and 64:
#   bash benchmarks/grammar_speed_cpu.sh OUT_DIR   (writes OUT_DIR/speed_schema, OUT_DIR/speed_free)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: grammar_speed_cpu.sh OUT_DIR}
H=$(.venv/bin/vllm-specplug build-model tiny-eagle3 | tail -1)
T="\"method\": \"specplug_eagle3\", \"model\": \"$H\""
for mode in schema free; do
  extra=(); [ "$mode" = schema ] && extra=(--json-schema benchmarks/json_schema.json)
  VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/vllm-specplug bench offline --model tiny --prompts held-out \
    --spec 'vllm-ngram-K5={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}' \
    --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$H\", \"num_speculative_tokens\": 5}" \
    --spec "ours-chain-K5={$T, \"topk\": 1, \"num_steps\": 5}" \
    --spec "ours-tree16={$T, \"topk\": 4, \"num_steps\": 4, \"num_draft_tokens\": 16}" \
    --spec "ours-tree16-deep={$T, \"topk\": 2, \"num_steps\": 8, \"num_draft_tokens\": 16}" \
    --spec "ours-tree16-deep-unmasked={$T, \"topk\": 2, \"num_steps\": 8, \"num_draft_tokens\": 16, \"grammar_drafts\": false}" \
    --batch-sizes 1 16 64 --limit-prompts 1=4 --num-prompts 64 --repeats 3 --max-tokens 64 \
    --dtype float32 --engine-args '{"enforce_eager": true}' "${extra[@]}" --out "$out/speed_$mode"
done
