"""Side-by-side speed and acceptance of speculative methods on one prompt set.

    .venv/bin/python benchmarks/bench_spec_methods.py --model tiny --batch 24

Writes the table to stdout and, with --plot, a PNG of per-position acceptance.
"""
from __future__ import annotations

import argparse
import os

from vllm_specplug.cli.demo import BUILTIN_METHODS
from vllm_specplug.models import MODEL_SPECS, build_model, held_out_prompts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SPECS))
    parser.add_argument("--batch", type=int, default=24, help="prompts per run")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--plot", default=None, help="PNG path for per-position acceptance")
    return parser.parse_args()


def plot_acceptance(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        rates = row.counts.per_position_acceptance
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o",
                    label=f"{row.name} (len {row.counts.mean_acceptance_length:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm_specplug.testing.sidebyside import format_table, run_side_by_side

    prompts = held_out_prompts(args.batch)
    rows = run_side_by_side(build_model(args.model), prompts, BUILTIN_METHODS,
                            args.max_tokens)
    print(f"model {args.model}, {len(prompts)} prompts, {args.max_tokens} tokens")
    print(format_table(rows))
    if args.plot:
        plot_acceptance(rows, args.plot)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
