#!/usr/bin/env bash
# Issue 26's measured runs on the staged GPU host (docs/gpu.md), each started
# detached (`start NAME`) and polled (`wait NAME [N]`: N polls 5 s apart, 100 by
# default; returns when its table is written or the run died, copies the results
# to $OUT: keep 5 N under the call's timeout, or the call dies before the copy;
# `dry-run NAME` prints the host.sh arguments a bench run would pass, on any machine):
#   tiny     vLLM eagle3 vs our chain and trees, tiny model + built-in head
#   tiny3    the same without tree 32, on fewer prompts (12 / 64 / 192), in one call:
#            OUT=$OUT bash benchmarks/gpu/v2_tree_runs.sh run tiny3 (TP=2: the target
#            sharded over a 2-GPU kind, detached: about 11 minutes; ROWS as smollm2's,
#            e.g. ROWS=compile)
#   tiny3-schema  tiny3 with every output under benchmarks/json_schema.json (issue 30;
#            ROWS=verify: vLLM eagle3 K=5 and our tree 16 with every row and with
#            grammar_verify "choices")
#   tiny-profile  tiny3's engines at batch 64, one repeat, with `--host-profile`
#   smollm2  the same on SmolLM2-135M-Instruct + its EAGLE-3 head, MT-Bench
#            (HEAD=dir, default .gpu/heads/smollm2-eagle3; RUN_NAME names the
#            results; ROWS=sized: plus our tree sized by batch; ROWS=split-ab: the sized
#            rows with our tree's attention both ways, split and rewrite; ROWS=chain-ab: the
#            sized rows plus our chain sized the same way as vLLM's; ROWS=adaptive: vLLM's
#            eagle3 K=5 fixed, sized and with its adaptive verification, our chain K=5 with
#            the same adaptive verification and our tree sized (issue 27); ROWS=bestk: vLLM's
#            eagle3 at K 3, 5 and 7, our chain K=5 and our tree 16 (issue 26); ROWS=bestk-wide:
#            vLLM's eagle3 at K 3, 5 and 7, our tree 16 and the wide tree (WIDE); ROWS=bestk-all:
#            the same plus our chain K=5 (one run for both of issue 26's goals); ROWS=compile:
#            vLLM's eagle3 K=5, our chain K=5 and tree 16 each as by default (draft_compile
#            on CUDA) and eager ("-eager"); ROWS=compile-aa: the same plus vLLM's eagle3 K=5
#            in a second engine (how far two engines of one config part); ROWS=tau-ab: vLLM's
#            eagle3 K=5, our chain K=5 as by default, eager, and eager on the PyTorch
#            head attention (draft_attention "torch"); ROWS=chains: vLLM's eagle3 K=5
#            and our chain K=5 alone (issue 26's τ gap; `by repeat` shows each repeat's
#            τ and prefix hits, NO_PREFIX_CACHE=1 the same without); ROWS=chains-lookup:
#            the same plus our chain with prompt_lookup_min 3; ROWS=lookups: vLLM's eagle3
#            K=5, our chain K=5 with lookups, tree 16 without and with them; ROWS=lookups-deep:
#            vLLM's eagle3 K=5, tree 16 without lookups, with them and with 12-token lookups
#            (prompt_lookup_tokens); ROWS=lookups-history:
#            vLLM's eagle3 K=5, tree 16 with lookups, its histories in GPU memory and through
#            UVA (token_history "host"); ROWS=wide: vLLM's
#            eagle3 K=5, our tree 16 and a wide tree (WIDE, default "8 4 32"); HOST_PROFILE=1:
#            plus where each row's host time goes, `bench offline --host-profile`)
#   smollm2-humaneval  the same on HumanEval
#   smollm2-sets  MT-Bench and HumanEval on the same engines, the real-target
#            issue's table (SETS, default "mt-bench humaneval"; SIZES, default "1 16 64"; CAPTURE, the largest captured
#            token count, default 1024; ROWS=full: vLLM eagle3 K 3/5/7, our chain, trees 8/16/32/64;
#            ROWS=free: vLLM ngram and suffix, ours ngram, suffix and hybrid; DTYPE=float32: the
#            engines in float32, outputs compared token for token (with F32=ieee: Triton's
#            float32 dots in IEEE, not TF32, any run); HEAD as above, default
#            .gpu/heads/smollm2-eagle3-demo)
#   smollm2-schema  issue 30 on SmolLM2 + its head (HEAD as smollm2-sets): MT-Bench's
#            first turns asking for an object, under its schema (--prompts mt-bench-json)
#            and without it (mt-bench-json-free) on the same engines: none, vLLM ngram and
#            eagle3 K=5, our chain K=5 and tree 16; batch SIZES (default 1 16 64); ADAPTIVE=1:
#            plus our tree 16 sized per step ("adaptive": true); SCHEMA_ROWS=first: vLLM
#            eagle3 K=5, our chain K=5 and tree 16 with grammar_drafts "first", tree 16 unmasked;
#            SCHEMA_ROWS=wide: our chain K=5 and a wide tree (WIDE="8 2 16": topk, steps,
#            nodes), both "first" (wide-choices: plus the wide tree with grammar_verify
#            "choices"); SCHEMA_ROWS=ab: our chain K=5 with its constrained
#            rows filled by the scheduler and in the worker (grammar_rows "worker", the
#            default); SCHEMA_ROWS=worker: the same plus vLLM eagle3 K=5 and the wide tree
#            (rows in the worker); SCHEMA_ROWS=queued: vLLM eagle3 K=5, our chain K=5
#            with rows in the worker after first-step masks and with unmasked drafts (the
#            rows read outputs the drafting pass queued, no device read in the step);
#            SCHEMA_ROWS=depth: vLLM eagle3 K=5 and our chain K=5 unmasked with its rows in
#            the worker as deep as drafts get accepted (grammar_row_depth "auto", the
#            default) and every row ("full");
#            DTYPE=float32 (with F32=ieee): outputs compared token for token, as smollm2-sets;
#            SCHEMA_ROWS=lean: vLLM eagle3 K=5 and our tree 16 with our defaults;
#            SCHEMA_ROWS=lean-rows: the same plus our tree 16 with grammar_tree_rows
#            ${TREE_ROWS:-8}; SCHEMA_ROWS=choices: the same plus our tree 16 with
#            grammar_verify "choices" (greedy trees decided from the target's choices),
#            with first-step masks and with unmasked drafts;
#            SCHEMA_ROWS=threads: the same plus our tree 16 with grammar_row_threads "auto";
#            SCHEMA_ROWS=threads-ab: our two trees of "threads" alone (one thread / "auto");
#            SCHEMA_ROWS=tree-rows: our tree 16 with every row and with grammar_tree_rows
#            ${TREE_ROWS:-8} (rows for its first drafts only), with no speculation;
#            PHASES=--phases: where each step's time goes;
#            SCHEMA_SETS="mt-bench-json" runs the schema set alone
#   smollm2-tp  SmolLM2 + its head on a sharded target (issue 29; TP ranks, default 3:
#            its 9 attention heads shard over 3 or 9, not 2, so a 4-GPU kind): vLLM eagle3
#            K=5 and ngram against our chain, tree 16 and specplug_ngram, MT-Bench (HEAD as
#            smollm2-sets)
#   tiny-batchk  issue 27: one draft length per step ("adaptive": true on V2) against
#            static lengths and vLLM's table, tiny model + its head, batch 1 4 16 64 128 256
#            (BATCHK=heads, the default: vLLM eagle3 K=5 fixed and sized, ours chain K=5
#            and tree 16 static and adaptive; BATCHK=lean: the same without our chain;
#            BATCHK=free: vLLM ngram, ours ngram static, default and one length per
#            step; BATCHK=tree: our tree 16 static and adaptive alone;
#            BATCHK=zero: vLLM eagle3 and our tree pinned at draft length 0 (what the
#            policy's floor costs beside no speculation), our tree static and adaptive;
#            BATCHK=floor: vLLM eagle3 K=5, our tree static, adaptive and pinned at 0;
#            BATCHK=pin: the same plus vLLM's table at 15 drafts and our policy pinned there;
#            BATCHK=shapes: vLLM eagle3 K=5 and 7 beside our tree 16 and two 32-node shapes
#            (SIZES=1: issue 26's batch-1 goal is our best tree over vLLM's best K); SIZES="1 16 64" and MAX_TOKENS=64 shorten it: the whole heads run
#            takes over 40 minutes; REPEATS, default 3: the engines start once, so a
#            repeat costs only its phases, a few seconds; JIT_VERBOSE=1: vLLM logs every
#            kernel compiled after its warm-up, `jit_monitor_verbose`)
#   smollm2-batchk  the same on SmolLM2 + its head (HEAD as smollm2-sets), MT-Bench, batch
#            1 4 16 64 (SIZES), BATCHK=lean by default, no phases (PHASES=--phases)
#   tiny-ramp issue 27's mixed online load: `vllm serve` per row (none, vLLM eagle3 K=5
#            and sized, our tree 16 static and adaptive; ROWS=a,b,... picks), started one
#            at a time, then `bench online --ramp 1 256` (RAMP="LOW HIGH"), REPEATS passes,
#            PER_CLIENT requests per client a stage (default 1: a pass of 766 requests
#            lasted 5-9 s on the tiny model, run13; benchmarks/gpu/ramp_servers.py);
#            start it, then wait over two calls
#   tiny-mtp vLLM's mtp vs our specplug_mtp chain (same K) and tree (MTP_COMPILE=1: both
#            also eager, without draft_compile; MTP_SIZED=1: vLLM's mtp and our tree sized by batch), on the tiny
#            target's MTP build (bench_tree_cuda.py prepare puts it in the work folder)
#   steps8b  step costs on the Llama-3-8B shape (bench_v2_steps.py; extra arguments go to
#            it; TP=2 shards the target over a 2-GPU kind; RUN_NAME names the results)
#   tp2-tests  tests/gpu/test_tensor_parallel_cuda.py on a 2-GPU kind (K="-k" expression)
#   tree-tests  host.sh v2-tree-tests detached, over several calls (K="-k" expression):
#            `start tree-tests`, then `wait tree-tests 110` until it prints DONE
# Every speculative engine of these runs is on Model Runner V2 (the bench
# records runner and speculator per row).
set -uo pipefail
# shellcheck source=benchmarks/smollm2_specs.sh
source "$(dirname "$0")/../smollm2_specs.sh"
export SPECPLUG_GPU_WORK=${SPECPLUG_GPU_WORK:-.gpu/work}
OUT=${OUT:-/tmp/out}
RESULTS=$HOME/results
W=$SPECPLUG_GPU_WORK
# tiny3, tiny-mtp, smollm2, smollm2-sets and smollm2-schema start their engines at once (bench offline
# --parallel-starts, bench/starts.py: each with a KV cache of half its memory share,
# or of PARALLEL_KV bytes), not one after the other (80-120 s an engine on the H200;
# three at once took 141 s instead of 338, docs/results/bench_parallel_starts_h200).
# PARALLEL= (empty): one after the other
PARALLEL=${PARALLEL-1}
PAR_KV=${PARALLEL_KV:+"\"kv_cache_memory_bytes\": $PARALLEL_KV, "}
PAR_ARG=${PARALLEL:+--parallel-starts}
# NO_PREFIX_CACHE=1 (smollm2, smollm2-sets): every engine without prefix caching (our chain's
# τ on SmolLM2 fell under vLLM's, 2026-12-04: our head's saved prefix rows on or off)
NOPFX=${NO_PREFIX_CACHE:+"\"enable_prefix_caching\": false, "}

prompt_args() {  # "SET SET ...": one `--prompts SET` pair a set, an argument a line
  local name
  for name in $1; do printf '%s\n' --prompts "$name"; done
}

wide_tree() {  # HEAD_DIR DEFAULT_SHAPE: a wide tree from WIDE="topk num_steps num_draft_tokens"
  # (else DEFAULT_SHAPE): sets wide_name (ours-tree-K-S-N) and wide (its JSON fields)
  local wk ws wn
  read -r wk ws wn <<< "${WIDE:-$2}"
  wide_name="ours-tree-$wk-$ws-$wn"
  wide="\"method\": \"specplug_eagle3\", \"model\": \"$1\", \"topk\": $wk, \"num_steps\": $ws, \"num_draft_tokens\": $wn, \"draft_temperature\": ${TREE_T:-0.25}"
}

vllm_k3_k7() {  # HEAD_DIR: vLLM's eagle3 at K 3 and 7, beside its K=5 row (issue 26's best K)
  local k
  for k in 3 7; do
    printf '%s\n' --spec "vllm-eagle3-K$k={\"method\": \"eagle3\", \"model\": \"$1\", \"num_speculative_tokens\": $k}"
  done
}

specs() {  # ROWS HEAD_DIR: the speculative rows (all: + tree 32; sized: trees and vLLM's
  # eagle3 sized by batch, no chain of ours; sized-only: the two sized rows alone)
  local h=$2
  local tree="\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 4, \"num_steps\": 4, \"num_draft_tokens\": 16, \"draft_temperature\": ${TREE_T:-0.25}"
  if [ "$1" = full ]; then full_specs full "$h"; return 0; fi
  # free: every model-free row (engines in their own processes here, so vLLM's
  # numba-backed ngram runs beside the others)
  if [ "$1" = free ]; then full_specs ngram "$h"; full_specs free "$h"; return 0; fi
  case "$1" in sized-only|split-ab|chain-ab) ;; *) printf '%s\n' --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" ;; esac
  local sized_k='"num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 24, 3], [25, 1024, 2]]'
  case "$1" in
    sized|sized-only|split-ab|chain-ab)
      # vLLM's dynamic speculative decoding: 5 drafts up to 4 requests, 3 up to 24, 2 beyond;
      # our tree the same way: 16 nodes, then 6, then 3
      printf '%s\n' --spec "vllm-eagle3-sized={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5, \"num_speculative_tokens_per_batch_size\": [[1, 4, 5], [5, 24, 3], [25, 1024, 2]]}"
      [ "$1" = sized ] && printf '%s\n' --spec "ours-tree16={$tree}"
      printf '%s\n' --spec "ours-tree-sized={$tree, \"num_speculative_tokens_per_batch_size\": [[1, 4, 15], [5, 24, 5], [25, 1024, 2]]}"
      # split-ab: the same tree with the first way of tree attention (backend, then rewrite)
      [ "$1" = split-ab ] && printf '%s\n' --spec "ours-tree-sized-rewrite={$tree, \"tree_attention\": \"rewrite\", \"num_speculative_tokens_per_batch_size\": [[1, 4, 15], [5, 24, 5], [25, 1024, 2]]}"
      # chain-ab: our chain with vLLM's table (issue 26: our chain >= vLLM's at the same K)
      [ "$1" = chain-ab ] && printf '%s\n' --spec "ours-chain-sized={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, $sized_k}"
      true ;;
    adaptive)
      # vLLM's adaptive verification: its estimator and cost curves rank each step's drafts
      local av='"enable_adaptive_verification": true'
      printf '%s\n' --spec "vllm-eagle3-sized={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5, $sized_k}"
      printf '%s\n' --spec "vllm-eagle3-K5-adaptive={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5, $av}"
      printf '%s\n' --spec "ours-chain-K5-adaptive={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, $av}"
      printf '%s\n' --spec "ours-tree-sized={$tree, \"num_speculative_tokens_per_batch_size\": [[1, 4, 15], [5, 24, 5], [25, 1024, 2]]}" ;;
    bestk)
      # issue 26's goals are over vLLM's best K and, for our chain, vLLM's at the same K:
      # its eagle3 at K 3 and 7 beside K 5 (above), our chain K=5 and our tree 16
      vllm_k3_k7 "$h"
      printf '%s\n' --spec "ours-chain-K5={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5}" \
        --spec "ours-tree16={$tree}" ;;
    bestk-wide|bestk-all)
      # issue 26's batch-1 goal (our best tree 1.2x vLLM's best K): vLLM's eagle3 at K 3
      # and 7 beside K 5 (above), our tree 16 and the wide tree (WIDE, default 8 4 32:
      # 1.25x vLLM K=5's decode speed on MT-Bench at batch 1, two repeats,
      # docs/results/smollm2_wide_h200_s60)
      wide_tree "$h" "8 4 32"
      vllm_k3_k7 "$h"
      printf '%s\n' --spec "ours-tree16={$tree}" --spec "$wide_name={$wide}"
      # bestk-all: plus our chain K=5 (issue 26: our chain >= vLLM's eagle3 at the same K)
      [ "$1" = bestk-all ] && printf '%s\n' --spec "ours-chain-K5={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5}"
      true ;;
    tau-ab)
      # our chain's τ fell to 0.95x vLLM's on SmolLM2 (bf16, H200, 2026-12-04) and not on
      # CPU: the drafting's GPU paths since it was equal, each turned off in turn
      # (draft_compile; then also the Triton head attention, draft_attention "torch")
      local chain="\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5"
      printf '%s\n' --spec "ours-chain-K5={$chain}" \
        --spec "ours-chain-K5-eager={$chain, \"draft_compile\": false}" \
        --spec "ours-chain-K5-torch-attn={$chain, \"draft_compile\": false, \"draft_attention\": \"torch\"}" ;;
    wide)
      # issue 26's tree against vLLM's chain with more nodes: our tree 16 and a wide tree
      # (WIDE="topk num_steps num_draft_tokens", default 8 4 32: on SmolLM2 its τ was 1.23x
      # our chain's on MT-Bench's object questions without a schema on the H200, and 1.27x
      # on MT-Bench's first turns on CPU, tree 16's 1.18x: docs/results/smollm2_tree_shapes_cpu)
      wide_tree "$h" "8 4 32"
      printf '%s\n' --spec "ours-tree16={$tree}" --spec "$wide_name={$wide}" ;;
    verify)
      # issue 30's ways of verifying a constrained greedy tree: tree 16 with every
      # node's row (the default) and decided from the target's choices ("auto" is
      # refused on Model Runner V2 for now: docs/results/v2_grammar_auto_h100)
      printf '%s\n' --spec "ours-tree16={$tree}" \
        --spec "ours-tree16-choices={$tree, \"grammar_verify\": \"choices\"}" ;;
    chains|chains-lookup)
      # the two chains alone: issue 26's τ gap on SmolLM2, without the other rows' work
      # between repeats (the tiny model's two chains drafted the same: tiny_chain_ab_h200)
      printf '%s\n' --spec "ours-chain-K5={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5}"
      # chains-lookup: plus our chain with prompt lookups where its history repeats
      # (proposers/lookup.py; SmolLM2's greedy loops, docs/results/smollm2_request_steps_h100_s73)
      [ "$1" = chains-lookup ] && printf '%s\n' --spec "ours-chain-K5-lookup={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, \"prompt_lookup_min\": 3}"
      true ;;
    lookups)
      # prompt lookups in both shapes (proposers/lookup.py): our chain K=5 with them,
      # tree 16 without and with them (a branch beside the head's nodes)
      printf '%s\n' --spec "ours-chain-K5-lookup={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, \"prompt_lookup_min\": 3}" \
        --spec "ours-tree16={$tree}" --spec "ours-tree16-lookup={$tree, \"prompt_lookup_min\": 3}" ;;
    lookups-deep)
      # trees' lookups as they reach: tree 16 without them, with them (4 deep: its
      # depth) and with prompt_lookup_tokens 12 (a branch below the head's nodes;
      # on CPU HumanEval 2.72 -> 3.30 tokens a verify step, exact)
      printf '%s\n' --spec "ours-tree16={$tree}" --spec "ours-tree16-lookup={$tree, \"prompt_lookup_min\": 3}" \
        --spec "ours-tree16-lookup-L12={$tree, \"prompt_lookup_min\": 3, \"prompt_lookup_tokens\": 12}" ;;
    lookups-history)
      # where the lookups' scans read the token histories: GPU memory (token_history
      # "auto", integration/v2/token_history.py) or vLLM's pinned host memory via UVA
      printf '%s\n' --spec "ours-tree16-lookup={$tree, \"prompt_lookup_min\": 3}" \
        --spec "ours-tree16-lookup-uva={$tree, \"prompt_lookup_min\": 3, \"token_history\": \"host\"}" ;;
    compile|compile-aa)
      # compile-aa: vLLM's eagle3 K=5 a second time, in an engine of its own: how far
      # two engines of one config part (the bias no interleaving removes)
      [ "$1" = compile-aa ] && printf '%s\n' --spec "vllm-eagle3-K5-again={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}"
      # draft_compile: our chain and tree as they run by default (the drafter's
      # dense steps through torch.compile on CUDA since the fifty-first session)
      # beside the same rows eager (issue 26: our drafting's GPU time at batch 16
      # and 64 was 1.3-2.3x vLLM's compiled head's); the eager rows were the
      # plain names and the compiled ones "-compiled" before that session
      local chain="\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5"
      printf '%s\n' --spec "ours-chain-K5={$chain}" \
        --spec "ours-chain-K5-eager={$chain, \"draft_compile\": false}" \
        --spec "ours-tree16={$tree}" --spec "ours-tree16-eager={$tree, \"draft_compile\": false}" ;;
    *)
      printf '%s\n' --spec "ours-chain-K5={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5}"
      printf '%s\n' --spec "ours-tree16={$tree}" ;;
  esac
  if [ "$1" = all ]; then
    printf '%s\n' --spec "ours-tree32={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 4, \"num_steps\": 8, \"num_draft_tokens\": 32, \"draft_temperature\": ${TREE_T:-0.25}}"
  fi
  return 0
}

batchk_specs() {  # heads|free HEAD_DIR: issue 27's rows, each static and adaptive
  local h=$2
  local tree="\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 4, \"num_steps\": 4, \"num_draft_tokens\": 16, \"draft_temperature\": ${TREE_T:-0.25}"
  local chain="\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5"
  local n='"num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5'
  if [ "$1" = free ]; then
    printf '%s\n' --spec "vllm-ngram={\"method\": \"ngram\", $n}" \
      --spec "ours-ngram-static={\"method\": \"specplug_ngram\", $n, \"adaptive\": false}" \
      --spec "ours-ngram-default={\"method\": \"specplug_ngram\", $n}" \
      --spec "ours-ngram-batch={\"method\": \"specplug_ngram\", $n, \"adaptive\": true}"
    return 0
  fi
  # tree: our tree's two rows alone (a run that fits what is left of a lease)
  [ "$1" = tree ] && printf '%s\n' --spec "ours-tree16={$tree}" \
    --spec "ours-tree16-adaptive={$tree, \"adaptive\": true}" && return 0
  # shapes: which tree shape is best at batch 1 (issue 26's 1.2x goal is for our best
  # tree over vLLM's best K): vLLM eagle3 K=5 and 7, our tree 16 and two of 32 nodes
  local head="\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"draft_temperature\": ${TREE_T:-0.25}"
  [ "$1" = shapes ] && printf '%s\n' \
    --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
    --spec "vllm-eagle3-K7={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 7}" \
    --spec "ours-tree16={$tree}" \
    --spec "ours-tree32-deep={$head, \"topk\": 4, \"num_steps\": 8, \"num_draft_tokens\": 32}" \
    --spec "ours-tree32-wide={$head, \"topk\": 8, \"num_steps\": 5, \"num_draft_tokens\": 32}" && return 0
  # zero: what a step at draft length 0 costs beside no speculation (the floor of the
  # batch policy where speculation loses): vLLM's eagle3 and our tree pinned at 0 by
  # vLLM's table, beside our static and adaptive trees
  local none_k='"num_speculative_tokens_per_batch_size": [[1, 1024, 0]]'
  [ "$1" = zero ] && printf '%s\n' \
    --spec "vllm-eagle3-K0={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5, $none_k}" \
    --spec "ours-tree16-K0={$tree, $none_k}" \
    --spec "ours-tree16={$tree}" --spec "ours-tree16-adaptive={$tree, \"adaptive\": true}" && return 0
  # zero0: the two rows pinned at 0 alone (with PHASES: where a length-0 step's time goes)
  [ "$1" = zero0 ] && printf '%s\n' \
    --spec "vllm-eagle3-K0={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5, $none_k}" \
    --spec "ours-tree16-K0={$tree, $none_k}" && return 0
  # floor: the policy against its own floor on a target where speculation may lose:
  # vLLM's eagle3 K=5, our static tree, the adaptive one, and our tree pinned at 0
  [ "$1" = floor ] && printf '%s\n' \
    --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
    --spec "ours-tree16={$tree}" --spec "ours-tree16-adaptive={$tree, \"adaptive\": true}" \
    --spec "ours-tree16-K0={$tree, $none_k}" && return 0
  # pin: where the adaptive tree's time goes beside the static one: vLLM's dynamic
  # table at one size (15 drafts at every batch), and our policy over that one size
  local one='"num_speculative_tokens_per_batch_size": [[1, 1024, 15]]'
  [ "$1" = pin ] && printf '%s\n' --spec "ours-tree16={$tree}" \
    --spec "ours-tree16-table15={$tree, $one}" \
    --spec "ours-tree16-pinned={$tree, $one, \"adaptive\": true}" \
    --spec "ours-tree16-adaptive={$tree, \"adaptive\": true}" && return 0
  printf '%s\n' --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
    --spec "vllm-eagle3-sized={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5, \"num_speculative_tokens_per_batch_size\": [[1, 4, 5], [5, 24, 3], [25, 1024, 2]]}"
  # trees: the chain rows only with BATCHK=heads (a lean run fits one lease)
  [ "$1" = heads ] && printf '%s\n' --spec "ours-chain-K5={$chain}" \
    --spec "ours-chain-adaptive={$chain, \"adaptive\": true}"
  printf '%s\n' --spec "ours-tree16={$tree}" --spec "ours-tree16-adaptive={$tree, \"adaptive\": true}"
}

host() {  # bash benchmarks/gpu/host.sh ARGS; under `dry-run` the arguments, one a line
  if [ "${DRY_RUN:-0}" = 1 ]; then printf '%s\n' "$@"; else bash benchmarks/gpu/host.sh "$@"; fi
}

tiny_bench() {  # NAME SPECS PROMPTS_AT_1 AT_16 AT_64 MAX_TOKENS CAPTURE [ARGS]: the tiny model's run
  # REPEATS (default 3): interleaved repeats; two engines of one config parted by
  # single repeats of 0.62-1.12x on the H200 (docs/results/v2_tiny3_aa_h200)
  mapfile -t S < <(specs "$2" "$W/tiny-eagle3")
  host tiny-bench "${S[@]}" --batch-sizes 1 16 64 \
    --limit-prompts "1=$3" --limit-prompts "16=$4" --limit-prompts "64=$5" --repeats "${REPEATS:-3}" \
    --max-tokens "$6" --dtype float32 --phases \
    --engine-args "{$PAR_KV${TP:+\"tensor_parallel_size\": $TP, }\"compilation_config\": {\"max_cudagraph_capture_size\": $7}}" \
    --out "$RESULTS/${RUN_NAME:-$1}" ${PAR_ARG} "${@:8}"  # where `wait` looks (it had copied
  # only the logs of a tiny3 run started with RUN_NAME, 2026-12-03)
}

run() {
  # TREE_T: our EAGLE trees' draft_temperature. 0.25 suits the tiny model's
  # under-confident head; SmolLM2's heads rank their nodes better at 1.0 (CPU
  # head: tree 16's τ 1.52 -> 1.62, 16-4-64's 1.72 -> 1.95;
  # docs/results/smollm2_tree_shapes_cpu_head), so SmolLM2's runs default to it
  case "$1" in smollm2*) : "${TREE_T:=1.0}" ;; esac
  case "$1" in
    tiny) tiny_bench tiny all 16 64 128 128 2048 ;;
    # the same minus tree 32, fewer prompts: fits one 10-minute call (ROWS picks other
    # rows, e.g. ROWS=compile: our chain and tree with draft_compile (the default) and eager,
    # a run that needs no SmolLM2 head)
    # prompts at batch 1 / 16 / 64: 12 / 64 / 192, 2-3 waves a repeat beyond batch 1 (one
    # wave of 0.4 s a repeat at 64 had spread our chain's ratio over 0.75-1.39x,
    # docs/results/v2_tiny3_compile_h200)
    # HOST_PROFILE=1: plus where each row's host time goes (`--host-profile`)
    tiny3) tiny_bench tiny3 "${ROWS:-three}" 12 64 192 96 1100 ${HOST_PROFILE:+--host-profile} ;;
    # the same under a JSON schema (issue 30; compare with tiny3)
    tiny3-schema) tiny_bench tiny3-schema "${ROWS:-three}" 12 64 192 96 1100 \
      --json-schema benchmarks/json_schema.json ;;
    # where each row's host time goes at batch 64 (one repeat; bench offline --host-profile)
    tiny-profile) tiny_bench tiny-profile three 8 32 64 96 1100 \
      --host-profile --batch-sizes 64 --repeats 1 ;;
    tiny-batchk)
      mapfile -t S < <(batchk_specs "${BATCHK:-heads}" "$W/tiny-eagle3")
      # SIZES / MAX_TOKENS: fewer for a run that fits one lease (BATCHK=lean)
      host tiny-bench "${S[@]}" --batch-sizes ${SIZES:-1 4 16 64 128 256} \
        --limit-prompts 1=6 --limit-prompts 4=16 --limit-prompts 16=48 --limit-prompts 64=128 \
        --limit-prompts 128=256 --limit-prompts 256=320 --repeats "${REPEATS:-3}" --max-tokens "${MAX_TOKENS:-96}" \
        --dtype float32 ${PHASES---phases} \
        --engine-args "{${JIT_VERBOSE:+\"jit_monitor_verbose\": true, }\"max_num_seqs\": 256, \"compilation_config\": {\"max_cudagraph_capture_size\": 1100}}" \
        --out "$RESULTS/${RUN_NAME:-tiny-batchk-${BATCHK:-heads}}" ;;
    smollm2-batchk)
      # issue 27 on the real target: SmolLM2 + its head (HEAD), MT-Bench, the lean rows
      # by default (an engine starts in about 2 minutes here); no phases unless PHASES=--phases
      mapfile -t S < <(batchk_specs "${BATCHK:-lean}" "${HEAD:-.gpu/heads/smollm2-eagle3-demo}")
      host real-bench --prompts mt-bench "${S[@]}" --batch-sizes ${SIZES:-1 4 16 64} \
        --limit-prompts 1=8 --limit-prompts 4=16 --limit-prompts 16=32 --limit-prompts 64=64 \
        --repeats "${REPEATS:-3}" --max-tokens "${MAX_TOKENS:-128}" ${PHASES-} \
        --engine-args "{${JIT_VERBOSE:+\"jit_monitor_verbose\": true, }\"compilation_config\": {\"max_cudagraph_capture_size\": 1024}}" \
        --out "$RESULTS/${RUN_NAME:-smollm2-batchk}" ;;
    tiny-mtp)
      local mtp_tree='"method": "specplug_mtp", "topk": 4, "num_steps": 4, "draft_temperature": 0.25'
      # MTP_SIZED=1: vLLM's mtp and our tree sized by batch (issue 26: the tree at batch 64
      # cost more than its tokens, docs/mtp.md), the tables of the EAGLE-3 rows (specs)
      local sized_k='"num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 24, 3], [25, 1024, 2]]'
      local sized_tree='"num_speculative_tokens_per_batch_size": [[1, 4, 15], [5, 24, 5], [25, 1024, 2]]'
      host tiny-bench --model "$W/tiny-mtp" \
        --spec 'vllm-mtp-K5={"method": "mtp", "num_speculative_tokens": 5}' \
        --spec 'ours-mtp-chain-K5={"method": "specplug_mtp", "topk": 1, "num_steps": 5}' \
        --spec "ours-mtp-tree16={$mtp_tree, \"num_draft_tokens\": 16}" \
        ${MTP_COMPILE:+--spec} ${MTP_COMPILE:+"ours-mtp-chain-K5-eager={\"method\": \"specplug_mtp\", \"topk\": 1, \"num_steps\": 5, \"draft_compile\": false}"} \
        ${MTP_COMPILE:+--spec} ${MTP_COMPILE:+"ours-mtp-tree16-eager={$mtp_tree, \"num_draft_tokens\": 16, \"draft_compile\": false}"} \
        ${MTP_SIZED:+--spec} ${MTP_SIZED:+"vllm-mtp-sized={\"method\": \"mtp\", \"num_speculative_tokens\": 5, $sized_k}"} \
        ${MTP_SIZED:+--spec} ${MTP_SIZED:+"ours-mtp-tree-sized={$mtp_tree, \"num_draft_tokens\": 16, $sized_tree}"} \
        --batch-sizes 1 16 64 --limit-prompts 1=12 --limit-prompts 16=64 --limit-prompts 64=192 \
        --repeats 3 --max-tokens 96 --dtype float32 --phases \
        --engine-args "{$PAR_KV\"compilation_config\": {\"max_cudagraph_capture_size\": 1100}}" \
        --out "$RESULTS/${RUN_NAME:-tiny-mtp}" ${PAR_ARG} ;;
    smollm2|smollm2-humaneval)
      # smollm2: MT-Bench (both turns); smollm2-humaneval: HumanEval
      local prompts=mt-bench; [ "$1" = smollm2-humaneval ] && prompts=humaneval
      mapfile -t S < <(specs "${ROWS:-three}" "${HEAD:-.gpu/heads/smollm2-eagle3}")
      host real-bench --prompts "${PROMPTS:-$prompts}" "${S[@]}" \
        --batch-sizes 1 16 64 --limit-prompts 1=8 --limit-prompts 16=32 \
        --limit-prompts 64=64 --repeats 3 --max-tokens 128 --phases ${HOST_PROFILE:+--host-profile} \
        --engine-args "{$PAR_KV$NOPFX\"compilation_config\": {\"max_cudagraph_capture_size\": 1024}}" \
        --out "$RESULTS/${RUN_NAME:-$1}" ${PAR_ARG} ;;
    smollm2-sets)
      # MT-Bench and HumanEval on the same engines (an engine's start costs more
      # than its generations here); ROWS=full (default): vLLM's eagle3 at K 3/5/7,
      # our chain and trees of 8-64 nodes; ROWS=free: the model-free rows
      mapfile -t S < <(specs "${ROWS:-full}" "${HEAD:-.gpu/heads/smollm2-eagle3-demo}")
      # PHASES=--phases: where each step's time goes; engines start at once (PARALLEL);
      # SIZES: fewer batch sizes; CAPTURE: the graphs' largest token count (1024: a
      # 33-token tree at batch 64 is 2112 and ran without graphs, 2026-12-05)
      # SETS: the sets run (default both; SETS=mt-bench for a lease with little left)
      mapfile -t P < <(prompt_args "${SETS:-mt-bench humaneval}")
      host real-bench "${P[@]}" "${S[@]}" \
        --batch-sizes ${SIZES:-1 16 64} --limit-prompts 1=8 --limit-prompts 16=32 \
        --limit-prompts 64=64 --repeats "${REPEATS:-3}" --max-tokens 128 ${PHASES-} \
        ${DTYPE:+--dtype "$DTYPE"} \
        --engine-args "{$PAR_KV$NOPFX\"compilation_config\": {\"max_cudagraph_capture_size\": ${CAPTURE:-1024}}}" \
        --out "$RESULTS/${RUN_NAME:-$1}" ${PAR_ARG} ;;
    smollm2-schema)
      h=${HEAD:-.gpu/heads/smollm2-eagle3-demo}
      tree="\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 4, \"num_steps\": 4, \"num_draft_tokens\": 16, \"draft_temperature\": ${TREE_T:-0.25}"
      chain_first="ours-chain-K5-first={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, \"grammar_drafts\": \"first\"}"
      # our chain K=5 drafting unmasked, its rows in the worker from the queued outputs
      chain_queued="\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, \"grammar_drafts\": false, \"grammar_rows\": \"worker\""
      if [ "${SCHEMA_ROWS:-all}" = first ]; then
        # grammar_drafts "first" (the root's children masked in the graphed pass): vLLM's
        # eagle3, our chain masked so, our tree 16 unmasked and masked so
        mapfile -t S < <(printf '%s\n' --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
          --spec "$chain_first" \
          --spec "ours-tree16={$tree}" --spec "ours-tree16-first={$tree, \"grammar_drafts\": \"first\"}")
      elif [ "${SCHEMA_ROWS:-all}" = wide ] || [ "${SCHEMA_ROWS:-all}" = wide-choices ]; then
        # a wide tree (WIDE="topk num_steps num_draft_tokens", default 8 2 16) against our
        # chain, both with the first drafting step masked; wide-choices: plus the wide tree
        # decided from the target's choices (grammar_verify "choices": no row a node; under
        # the schema on the H200 the rows took the 8-4-32 tree's decode to 2.5x, 2026-12-04)
        wide_tree "$h" "8 2 16"
        mapfile -t S < <(printf '%s\n' \
          --spec "$chain_first" \
          --spec "$wide_name-first={$wide, \"grammar_drafts\": \"first\"}"
          [ "$SCHEMA_ROWS" = wide-choices ] && printf '%s\n' \
            --spec "$wide_name-choices={$wide, \"grammar_verify\": \"choices\"}")
      elif [ "${SCHEMA_ROWS:-all}" = queued ]; then
        # rows in the worker from the outputs the drafting pass queued (drafts unmasked,
        # no read of the device in the step) against rows in the worker after the first
        # step's masks (which read it) and vLLM's eagle3; both of ours chains K=5
        mapfile -t S < <(printf '%s\n' \
          --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
          --spec "ours-chain-K5-first-worker-rows={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, \"grammar_drafts\": \"first\", \"grammar_rows\": \"worker\"}" \
          --spec "ours-chain-K5-queued-rows={$chain_queued}")
      elif [ "${SCHEMA_ROWS:-all}" = depth ]; then
        # a chain's rows in the worker only as deep as its drafts get accepted (RowDepth)
        # against every row; both unmasked, the outputs queued
        mapfile -t S < <(printf '%s\n' \
          --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
          --spec "ours-chain-K5-queued-depth-auto={$chain_queued, \"grammar_row_depth\": \"auto\"}" \
          --spec "ours-chain-K5-queued-depth-full={$chain_queued, \"grammar_row_depth\": \"full\"}")
      elif [ "${SCHEMA_ROWS:-all}" = threads ]; then
        # our tree 16 with xgrammar's walks of its rows on one host thread (the default)
        # and on "auto" threads (integration/row_threads.py), beside vLLM's eagle3 K=5
        mapfile -t S < <(printf '%s\n' \
          --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
          --spec "ours-tree16={$tree}" \
          --spec "ours-tree16-row-threads={$tree, \"grammar_row_threads\": \"auto\"}")
      elif [ "${SCHEMA_ROWS:-all}" = threads-ab ]; then
        # the same two trees alone (with no speculation, the baseline): one thread
        # against "auto", for a lease with little left (SIZES=64, where the walks weigh)
        mapfile -t S < <(printf '%s\n' --spec "ours-tree16={$tree}" \
          --spec "ours-tree16-row-threads={$tree, \"grammar_row_threads\": \"auto\"}")
      elif [ "${SCHEMA_ROWS:-all}" = tree-rows ]; then
        # every node's row against the first TREE_ROWS drafts' only (the walks' host
        # time against the deep nodes' tokens; SIZES="16 64", where the walks weigh)
        mapfile -t S < <(printf '%s\n' --spec "ours-tree16={$tree}" \
          --spec "ours-tree16-rows${TREE_ROWS:-8}={$tree, \"grammar_tree_rows\": ${TREE_ROWS:-8}}")
      elif [ "${SCHEMA_ROWS:-all}" = lean-rows ]; then
        # "lean" plus our tree 16 with grammar_tree_rows ${TREE_ROWS:-8}: both trees
        # against vLLM's eagle3 K=5 in one run that fits a lease after staging
        mapfile -t S < <(printf '%s\n' \
          --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
          --spec "ours-tree16={$tree}" \
          --spec "ours-tree16-rows${TREE_ROWS:-8}={$tree, \"grammar_tree_rows\": ${TREE_ROWS:-8}}")
      elif [ "${SCHEMA_ROWS:-all}" = choices ]; then
        # greedy trees decided from the target's choices (grammar_verify "choices":
        # no rows for them, one wait for the forward) against every node's row, with
        # vLLM's eagle3 K=5; and the choices with unmasked drafts (no first-step
        # masks: their read of the outputs waits for the GPU in the drafting pass)
        mapfile -t S < <(printf '%s\n' \
          --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
          --spec "ours-tree16={$tree}" \
          --spec "ours-tree16-choices={$tree, \"grammar_verify\": \"choices\"}" \
          --spec "ours-tree16-choices-unmasked={$tree, \"grammar_verify\": \"choices\", \"grammar_drafts\": false}")
      elif [ "${SCHEMA_ROWS:-all}" = lean ]; then
        # vLLM's eagle3 K=5 against our tree 16, both as a user gets them (our defaults:
        # first-step masks, rows in the worker): a run that fits a lease after a head build
        mapfile -t S < <(printf '%s\n' \
          --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
          --spec "ours-tree16={$tree}")
      elif [ "${SCHEMA_ROWS:-all}" = ab ] || [ "${SCHEMA_ROWS:-all}" = worker ]; then
        # our chain with its constrained rows filled by the scheduler (vLLM's deferred
        # step) against the worker (grammar_rows "worker", the default since 2026-12-02:
        # the runs of that day named the scheduler's row ours-chain-K5-first);
        # SCHEMA_ROWS=worker adds vLLM's eagle3 and a wide tree (WIDE, default 8 2 16)
        # with the worker's rows
        chain_scheduler="ours-chain-K5-first-scheduler-rows={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, \"grammar_drafts\": \"first\", \"grammar_rows\": \"scheduler\"}"
        chain_worker="ours-chain-K5-first-worker-rows={\"method\": \"specplug_eagle3\", \"model\": \"$h\", \"topk\": 1, \"num_steps\": 5, \"grammar_drafts\": \"first\", \"grammar_rows\": \"worker\"}"
        wide_tree "$h" "8 2 16"
        mapfile -t S < <(printf '%s\n' --spec "$chain_scheduler" --spec "$chain_worker"
          [ "$SCHEMA_ROWS" = worker ] && printf '%s\n' \
            --spec "vllm-eagle3-K5={\"method\": \"eagle3\", \"model\": \"$h\", \"num_speculative_tokens\": 5}" \
            --spec "$wide_name-first-worker-rows={$wide, \"grammar_drafts\": \"first\", \"grammar_rows\": \"worker\"}")
      else
      mapfile -t S < <(printf '%s\n' --spec 'vllm-ngram-K5={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
                       specs three "$h"
                       # ADAPTIVE=1: our tree 16 with one size per step, priced by
                       # measured step times (which hold the grammar's fill of its rows)
                       [ "${ADAPTIVE:-0}" = 1 ] && printf '%s\n' --spec "ours-tree16-adaptive={$tree, \"adaptive\": true}")
      fi
      mapfile -t P < <(prompt_args "${SCHEMA_SETS:-mt-bench-json mt-bench-json-free}")
      host real-bench "${P[@]}" \
        "${S[@]}" --batch-sizes ${SIZES:-1 16 64} --limit-prompts 1=8 --limit-prompts 16=32 \
        --limit-prompts 64=64 --repeats "${REPEATS:-3}" --max-tokens 128 ${DTYPE:+--dtype "$DTYPE"} \
        --engine-args "{$PAR_KV\"compilation_config\": {\"max_cudagraph_capture_size\": ${CAPTURE:-1024}}}" \
        ${PHASES-} --out "$RESULTS/${RUN_NAME:-$1}" ${PAR_ARG} ;;
    smollm2-tp)
      # the head rows of `smollm2` and the n-gram rows of smollm2-sets, on a sharded target
      mapfile -t S < <(specs three "${HEAD:-.gpu/heads/smollm2-eagle3-demo}"; full_specs ngram -)
      host real-bench --prompts mt-bench "${S[@]}" \
        --batch-sizes 1 16 64 --limit-prompts 1=8 --limit-prompts 16=32 \
        --limit-prompts 64=64 --repeats 3 --max-tokens 128 \
        --engine-args "{\"tensor_parallel_size\": ${TP:-3}, \"compilation_config\": {\"max_cudagraph_capture_size\": 1024}}" \
        --out "$RESULTS/${RUN_NAME:-$1}" ;;
    steps8b)
      # spawn: a forked engine after CUDA is up hung at model loading (2026-11-25)
      export PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
      export VLLM_WORKER_MULTIPROC_METHOD=spawn
      python3 benchmarks/gpu/bench_v2_steps.py run --work "$W" --out "$RESULTS/${RUN_NAME:-steps8b}" ${TP:+--tensor-parallel-size "$TP"} \
        "${@:2}" ;;
    tiny-ramp)
      # issue 27's mixed online load: a server per row, then bench online --ramp
      export PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
      python3 benchmarks/gpu/ramp_servers.py --work "$W" --out "$RESULTS/${RUN_NAME:-tiny-ramp}" \
        ${ROWS:+--rows "$ROWS"} ${RAMP:+--ramp $RAMP} --repeats "${REPEATS:-3}" \
        ${PER_CLIENT:+--requests-per-client "$PER_CLIENT"} ;;
    tree-tests)
      # host.sh v2-tree-tests detached: the suite starts about 10 engines and
      # outgrew one 10-minute call (2026-11-28); -k K selects, TRITON_F32_DEFAULT passes through
      export PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
      export VLLM_WORKER_MULTIPROC_METHOD=spawn
      mkdir -p "$RESULTS/tree-tests"
      python3 -m pytest -v -rfs --tb=short tests/kernels/test_tree_rows.py tests/kernels/test_gumbel_reference.py \
        tests/kernels/test_topp_rows.py tests/gpu/test_batch_draft_cuda.py \
        tests/gpu/test_tree_eagle_cuda.py ${K:+-k "$K"} > "$RESULTS/tree-tests/pytest.txt" 2>&1
      tail -12 "$RESULTS/tree-tests/pytest.txt" ;;
    tp2-tests)
      export PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
      export VLLM_WORKER_MULTIPROC_METHOD=spawn
      mkdir -p "$RESULTS/tp2-tests"
      python3 -m pytest -v -rs tests/gpu/test_tensor_parallel_cuda.py ${K:+-k "$K"} \
        > "$RESULTS/tp2-tests/pytest.txt" 2>&1
      tail -5 "$RESULTS/tp2-tests/pytest.txt" ;;
  esac
}

case "$1" in
  start)
    # the device tool replaces the working tree at every call: run from a copy
    # (carry .gpu/work and .gpu/heads in the call that starts a run)
    mkdir -p "$RESULTS"
    rm -rf "$HOME/repo-$2" && cp -r . "$HOME/repo-$2"
    (cd "$HOME/repo-$2" && setsid nohup bash benchmarks/gpu/v2_tree_runs.sh run-now "${@:2}" \
      > "$HOME/$2.log" 2>&1 < /dev/null & disown)
    echo "started $2 in $HOME/repo-$2" ;;
  # extra arguments after the name reach the run (steps8b passes them to bench_v2_steps.py)
  # F32=ieee: IEEE float32 in every Triton tl.dot, vLLM's attention's and ours (Triton's
  # default on CUDA is TF32, 10-bit mantissas: float32 SmolLM2 differed from no speculation
  # for vLLM's eagle3 too, docs/results/smollm2_fp32_h100_s65)
  run-now) export OUT=$HOME/out-$2; mkdir -p "$OUT"
    [ -n "${F32:-}" ] && export TRITON_F32_DEFAULT="$F32"
    run "${@:2}"; echo "DONE $2 rc=$?" ;;
  run) mkdir -p "$RESULTS" "$OUT"; run "${@:2}"; cp -r "$RESULTS/$2" "$OUT/" ;;
  # the host.sh call a bench run would make, printed one argument a line, run
  # nowhere: its specs are checked on CPU before they cost device time
  # (tests/test_gpu_runs.py)
  dry-run) DRY_RUN=1 run "${@:2}" ;;
  wait)
    for _ in $(seq "${3:-100}"); do
      grep -q "^DONE $2" "$HOME/$2.log" 2>/dev/null && break
      sleep 5
    done
    # results under RUN_NAME when the run was started with one; the run's
    # own output is in $HOME/out-NAME (host.sh writes its log there)
    mkdir -p "$OUT/$2"
    cp "$RESULTS/${RUN_NAME:-$2}"/* "$OUT/$2/" 2>/dev/null
    cp "$HOME/$2.log" "$OUT/$2/run.log"
    cp "$HOME/out-$2"/*.log "$OUT/$2/" 2>/dev/null
    grep -a "DONE\|Error\|error:" "$HOME/$2.log" | tail -5
    tail -c 2500 "$HOME/$2.log" ;;
esac
