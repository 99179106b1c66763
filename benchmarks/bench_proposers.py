"""Our proposers against vLLM's built-in methods and no speculation, side by
side on the same prompts in one run, on two prompt sets (held-out code, and a
repetitive "repeat and edit this code" workload).

    .venv/bin/python benchmarks/bench_proposers.py --model tiny --plot docs/results/proposers_tiny.png

Also times one proposer step of our n-gram against vLLM's (numba) n-gram on
synthetic histories (`--micro`). Prints mean acceptance length (tokens per
verify step), per-position acceptance, tokens/s and the ratio to no
speculation.
"""
from __future__ import annotations

import argparse
import os
import time
import types

import numpy as np

from vllm_specplug.models import MODEL_SPECS, build_model, held_out_prompts
from vllm_specplug.models.corpus import repetitive_prompts

K = 5
METHODS: dict[str, dict | None] = {
    "none": None,
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": K,
                   "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": K},
    "specplug_ngram": {"method": "specplug_ngram", "num_speculative_tokens": K,
                       "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "specplug_suffix": {"method": "specplug_suffix", "num_speculative_tokens": K},
    "specplug_hybrid": {"method": "specplug_hybrid", "num_speculative_tokens": K,
                        "proposers": [{"method": "specplug_suffix", "min_token_prob": 0.2},
                                      {"method": "specplug_ngram", "prompt_lookup_max": 5}]},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SPECS))
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--plot", default=None, help="PNG of per-position acceptance")
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


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), sharey=True)
    for ax, (name, rows) in zip(np.atleast_1d(axes), results.items()):
        for row in rows:
            rates = row.counts.per_position_acceptance
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o",
                        label=f"{row.name} (len {row.counts.mean_acceptance_length:.2f}, "
                              f"x{row.speedup:.2f})")
        ax.set(title=name, xlabel="draft position", ylim=(0, 1))
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("acceptance rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    micro_benchmark()
    if args.micro:
        return
    from vllm_specplug.testing.sidebyside import format_table, run_side_by_side

    model_dir = build_model(args.model)
    prompt_sets = {"held-out code": held_out_prompts(args.batch),
                   "repeat and edit": repetitive_prompts(args.batch)}
    results = {}
    for name, prompts in prompt_sets.items():
        results[name] = run_side_by_side(model_dir, prompts, METHODS, args.max_tokens)
        print(f"\n{name}: model {args.model}, {len(prompts)} prompts, "
              f"{args.max_tokens} new tokens, greedy, one batch, K={K}")
        print(format_table(results[name]))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
