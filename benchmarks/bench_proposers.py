"""Our proposers against vLLM's built-in methods and no speculation, side by
side on the same prompts in one run, on two prompt sets (held-out code, and a
repetitive "repeat and edit this code" workload): a thin caller of
`vllm-specplug bench offline`.

    .venv/bin/python benchmarks/bench_proposers.py --model tiny --out docs/results/proposers_tiny

Also times one proposer step of our n-gram against vLLM's (numba) n-gram on
synthetic histories (`--micro`). Prints mean acceptance length (tokens per
verify step), per-position acceptance, tokens/s and the ratio to no
speculation; writes table, JSON and PNG per prompt set under `--out`.
"""
from __future__ import annotations

import argparse
import json
import time
import types

import numpy as np

from vllm_specplug.models import MODEL_SPECS

# The demo's methods: vLLM's n-gram and suffix and ours at the same K.
from vllm_specplug.cli.demo import DEMO_METHODS as METHODS, K  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SPECS))
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="results prefix (DIR/NAME)")
    parser.add_argument("--micro", action="store_true", help="only the proposer-step timing")
    return parser.parse_args()


def vllm_ngram(k: int, max_model_len: int, max_num_seqs: int):
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(prompt_lookup_min=2, prompt_lookup_max=5,
                                                 num_speculative_tokens=k),
        model_config=types.SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
    return NgramProposer(config)


def time_call(fn, repeats: int = 200, warmup: int = 10) -> float:
    """Median microseconds of single calls after a warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def micro_benchmark() -> None:
    from vllm_specplug.proposers.base import ProposeBatch, ProposerContext
    from vllm_specplug.proposers.ngram import NgramOptions, NgramProposer

    print("proposer step, median microseconds of 200 calls (synthetic repetitive histories)")
    print(f"{'batch':>6}{'history':>9}{'vLLM ngram':>12}{'specplug_ngram':>16}{'ratio':>7}")
    rng = np.random.default_rng(0)
    for batch in (1, 16, 64):
        for length in (256, 1024):
            motif = rng.integers(0, 4096, size=(batch, 40))
            tokens = np.concatenate([motif, rng.integers(0, 4096, (batch, length))], 1)
            tokens[:, -8:] = motif[:, :8]  # the tail repeats the start
            tokens = tokens[:, -length:].astype(np.int32)
            theirs = vllm_ngram(K, length + 64, 1024)
            counts = np.full(batch, length, dtype=np.int32)
            ours = NgramProposer(NgramOptions(2, 5), ProposerContext(K, length + 64, 4096, "cpu"))
            ids = [str(i) for i in range(batch)]
            ours_us = time_call(lambda: ours.propose(ProposeBatch(ids, tokens, counts.astype(np.int64), K)))
            theirs_us = time_call(lambda: theirs.propose(K, [[1]] * batch, counts, tokens))
            print(f"{batch:>6}{length:>9}{theirs_us:>12.1f}{ours_us:>16.1f}{theirs_us / ours_us:>7.2f}")


def main() -> None:
    args = parse_args()
    micro_benchmark()
    if args.micro:
        return
    from vllm_specplug.cli.main import main as cli

    for prompt_set in ("held-out", "repeat-edit"):
        print(f"\n{prompt_set}: model {args.model}, K={K}")
        argv = ["bench", "offline", "--model", args.model, "--prompts", prompt_set,
                "--num-prompts", str(args.batch), "--batch-sizes", str(args.batch),
                "--repeats", "1", "--max-tokens", str(args.max_tokens)]
        argv += [f"--spec={name}={json.dumps(config)}" for name, config in METHODS.items()]
        if args.out:
            argv += ["--out", f"{args.out}_{prompt_set}"]
        cli(argv)


if __name__ == "__main__":
    main()
