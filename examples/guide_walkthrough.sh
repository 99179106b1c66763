#!/usr/bin/env bash
# docs/guide.md, run end to end on the built-in tiny model: prompts -> hidden
# states -> EAGLE-3 head -> offline check -> `vllm serve` -> online benchmark.
# Usage: bash examples/guide_walkthrough.sh [WORK_DIR]   (about 10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-$(mktemp -d /tmp/specplug-guide-XXXX)}"
mkdir -p "$WORK"
export PATH="$PWD/.venv/bin:$PATH" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
MODEL=$(vllm-specplug build-model tiny | tail -n 1)

# 0. Two prompt files in the chat format: the target's training split (to learn
#    from) and held-out code (to measure on).
python - "$WORK" <<'PY'
import json, sys
from vllm_specplug.models.corpus import chat_conversations, held_out_prompts, train_prompts
for name, prompts in (("train", train_prompts(400)), ("eval", held_out_prompts(24))):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in chat_conversations(prompts))
PY

# 1. The target answers the training prompts; its hidden states are saved.
vllm-specplug extract --model "$MODEL" --prompts "$WORK/train.jsonl" --out "$WORK/data" \
    --regenerate --max-new-tokens 64 2>&1 | tail -n 1 | tee "$WORK/1-extract.txt"
# 2. An EAGLE-3 head is trained on them.
vllm-specplug train-eagle3 --data "$WORK/data" --target "$MODEL" --out "$WORK/head" \
    2>&1 | tail -n 1 | tee "$WORK/2-train.txt"
# 3. Acceptance and speed offline, beside no speculation and a model-free method.
vllm-specplug bench offline --model "$MODEL" --prompts "$WORK/eval.jsonl" \
    --spec eagle3="{\"method\": \"eagle3\", \"model\": \"$WORK/head\", \"num_speculative_tokens\": 3}" \
    --spec '{"method": "specplug_suffix", "num_speculative_tokens": 4}' \
    --batch-sizes 1 24 --repeats 2 --max-tokens 64 --max-model-len 1024 --out "$WORK/offline" \
    2>/dev/null | tee "$WORK/3-offline.txt"
# 4. Two servers: without speculation, and with the head.
vllm serve "$MODEL" --port 8000 --max-model-len 1024 --served-model-name tiny \
    > "$WORK/serve-none.log" 2>&1 &
PLAIN=$!
vllm serve "$MODEL" --port 8001 --max-model-len 1024 --served-model-name tiny \
    --speculative-config "{\"method\": \"eagle3\", \"model\": \"$WORK/head\", \"num_speculative_tokens\": 3}" \
    > "$WORK/serve-eagle3.log" 2>&1 &
SPEC=$!
trap 'kill $PLAIN $SPEC 2>/dev/null || true' EXIT
for port in 8000 8001; do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 2; done
done
# 5. Both servers under concurrent streaming clients.
vllm-specplug bench online --url none=http://127.0.0.1:8000 --url eagle3=http://127.0.0.1:8001 \
    --prompts "$WORK/eval.jsonl" --concurrency 1 8 --max-tokens 64 --out "$WORK/online" \
    2>/dev/null | tee "$WORK/5-online.txt"
echo "work directory: $WORK"
