# The real-target issue's rows (issue 25), shared by the CPU tables
# (benchmarks/smollm2_tables.sh) and the GPU ones (gpu/v2_tree_runs.sh
# smollm2-sets): `full_specs full|free HEAD_DIR` prints `--spec NAME=JSON`
# arguments for `vllm-specplug bench offline`, all at K=5 unless named.
# TREE_T: the trees' draft_temperature (default 0.25; the callers on SmolLM2 set 1.0)
full_specs() {  # full|free|ngram HEAD_DIR
  local h=$2 k
  if [ "$1" = ngram ]; then  # vLLM's ngram loads numba: a run of its own on CPU
    local n='"num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5'
    printf '%s\n' --spec "vllm-ngram={\"method\": \"ngram\", $n}" \
      --spec "specplug_ngram={\"method\": \"specplug_ngram\", $n}"
    return 0
  fi
  if [ "$1" = free ]; then  # suffix and hybrid rows
    # The global suffix cache is off: the tables run the same prompts three
    # times (and warm up on them), and with the cache a pass drafts from the
    # same prompts' earlier answers (H100, MT-Bench: tau 5.3 against 1.5-1.7)
    local c='"suffix_decoding_max_cached_requests": 0' o='"max_cached_requests": 0'
    printf '%s\n' --spec "vllm-suffix={\"method\": \"suffix\", \"num_speculative_tokens\": 5, $c}" \
      --spec "specplug_suffix={\"method\": \"specplug_suffix\", \"num_speculative_tokens\": 5, $o}" \
      --spec "specplug_hybrid={\"method\": \"specplug_hybrid\", \"num_speculative_tokens\": 5, \"proposers\": [{\"method\": \"specplug_suffix\", \"min_token_prob\": 0.2, $o}, {\"method\": \"specplug_ngram\", \"prompt_lookup_max\": 5}]}"
    return 0
  fi
  for k in 3 5 7; do
    printf '%s\n' --spec "vllm-eagle3-K$k={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": $k}"
  done
  printf '%s\n' --spec "ours-chain-K5={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5}"
  # EAGLE-2 trees: top-k expansions, the best N-1 nodes by path score kept
  # (N <= 1 + topk * num_steps)
  local n steps topk
  for n in 8 16 32 64; do
    steps=$(( n == 8 ? 3 : (n == 16 ? 4 : 8) )); topk=$(( n == 64 ? 8 : 4 ))
    printf '%s\n' --spec "ours-tree$n={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": $topk, \"num_steps\": $steps, \"num_draft_tokens\": $n, \"draft_temperature\": ${TREE_T:-0.25}}"
  done
}

