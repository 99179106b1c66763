"""Does one engine slow down over repeated identical batches? (issue 27)

The same MT-Bench first turns, greedy, `--calls` times on one engine (in
this process: run with VLLM_ENABLE_V1_MULTIPROCESSING=0 to profile the
engine core too), each call's wall time printed; `--profile` calls also
print their functions with the most own time (cProfile). In the batch-policy
runs on CPU a speculative row's repeats fell from first to last while no
speculation's did not (docs/results/batch_draft_length_cpu_run11,
docs/results/suffix_drift_cpu): this isolates the engine from the bench's
other engines.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python \\
        benchmarks/repeat_drift.py --model DIR \\
        --spec '{"method": "specplug_suffix", "num_speculative_tokens": 5, "max_cached_requests": 0}'
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time


def profiled_call(llm, prompts, params, profile: bool) -> float:
    """One `chat` call's wall seconds; with `profile`, its top functions printed."""
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
        print("\n".join(text.getvalue().splitlines()[:40]))
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory")
    parser.add_argument("--spec", help="speculative_config as JSON (none: no speculation)")
    parser.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns a call")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--profile", type=int, nargs="*", default=[1], help="calls to profile")
    args = parser.parse_args(argv)
    from vllm import LLM, SamplingParams

    from vllm_specplug.public_sets import mt_bench

    prompts = [[{"role": "user", "content": turns[0]}] for turns in mt_bench(args.prompts)]
    llm = LLM(args.model, dtype="float32", max_model_len=2048, max_num_seqs=args.prompts,
              speculative_config=json.loads(args.spec) if args.spec else None, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for call in range(args.calls):
        seconds = profiled_call(llm, prompts, params, call in args.profile)
        print(f"call {call}: {seconds:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
