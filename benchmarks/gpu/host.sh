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
set -uo pipefail
export PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export VLLM_WORKER_MULTIPROC_METHOD=spawn
export SPECPLUG_GPU_WORK=${SPECPLUG_GPU_WORK:-.gpu/work}
OUT=${OUT:-/tmp/out}
RESULTS=$HOME/results
mkdir -p "$OUT" "$RESULTS"
quiet() { grep -v "^INFO\|^(EngineCore\|^(MainProcess\|^(Worker\|WARNING\|^\[" ; }
case "${1:-}" in
  install)
    [ -d "$HOME/vsite/vllm" ] || bash .gpu/unpack.sh || exit 1
    # arctic-inference (suffix decoding), a cp312 wheel built by scripts/stage-arctic.sh
    python3 -m pip install -q --no-deps --no-index --upgrade --target "$HOME/vsite" \
      .gpu/whl/*.whl 2>&1 | tail -3
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade \
      --target "$HOME/vsite" . 2>&1 | tail -3
    python3 -c "import vllm, vllm_specplug, arctic_inference.suffix_decoding as s, torch
print('vllm', vllm.__version__, 'torch', torch.__version__, 'arctic ok', s.__name__)" ;;
  smoke)
    ln -sfn ../kernels vllm_specplug/kernels
    python3 -m pytest tests/gpu -q -rs -x -k "runs_on_model_runner_v2 and async" \
      2>&1 | tee "$OUT/smoke.log" | tail -30 ;;
  tests)
    # pytest puts the checkout first on sys.path, where kernels/ is not yet
    # vllm_specplug/kernels as in an install: link it there (host copy only).
    ln -sfn ../kernels vllm_specplug/kernels
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
    ln -sfn ../kernels vllm_specplug/kernels
    timeout 300 python3 -m pytest -q -rs tests/kernels/test_tree_attention.py \
      tests/kernels/test_tree_attention_flex.py tests/kernels/test_cuda_tree_attention.py \
      "tests/gpu/test_tree_eagle_cuda.py::test_graphed_drafting_equals_eager_drafting" 2>&1 \
      | tee "$OUT/pytest_tree.log" | quiet | tail -30 ;;
  report)
    python3 benchmarks/gpu/bench_model_runner_v2.py report --results "$RESULTS" --out "$OUT" ;;
  *) echo "usage: host.sh install|smoke|tests|bench|report|tree-tiny|tree-costs|tree-kernel|tree-tests"
     exit 2 ;;
esac
