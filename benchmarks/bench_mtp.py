"""MTP: no speculation, vLLM's `mtp` (chains), and ours (`specplug_mtp`:
the same MTP layer drafting chains and EAGLE-2 trees), one run.

On the built-in `tiny-mtp` (the tiny target with one MTP layer trained by our
code; or --model, any MTP-capable model in MiMo's layout), held-out chat
prompts: vLLM's `mtp` and ours with topk=1 at K = 3 and 5, trees at the same
verified-token budget (4 and 6 nodes) and larger (16, 32 nodes), each tree at
draft_temperature 1 and 0.25. A thin caller of `vllm-specplug bench offline`:
acceptance length, per-depth acceptance, tokens/s, ratio to no speculation;
table, JSON and PNG under --out.

    .venv/bin/python benchmarks/bench_mtp.py --out docs/results/mtp_tiny
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench_tree_eagle import chat_prompts_file

CHAINS = (3, 5)
TREES = {  # name: (topk, num_steps, num_draft_tokens)
    "tree4-topk2": (2, 3, 4),    # the verified-token budget of the K=3 chain
    "tree6-topk2": (2, 5, 6),    # the budget of the K=5 chain
    "tree16-topk4": (4, 4, 16),
    "tree32-topk4": (4, 8, 32),
}


def specs(temperatures: list[float]) -> dict[str, dict]:
    out = {}
    for k in CHAINS:
        out[f"vllm-mtp-k{k}"] = {"method": "mtp", "num_speculative_tokens": k}
        out[f"ours-chain-k{k}"] = {"method": "specplug_mtp", "topk": 1, "num_steps": k}
    for temperature in temperatures:
        for name, (topk, steps, nodes) in TREES.items():
            out[f"ours-{name}-T{temperature:g}"] = {
                "method": "specplug_mtp", "topk": topk, "num_steps": steps,
                "num_draft_tokens": nodes, "draft_temperature": temperature}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="MTP-capable model (default: tiny-mtp)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[24])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--draft-temperatures", type=float, nargs="+", default=[1.0, 0.25])
    parser.add_argument("--out", default=None, help="directory for table, JSON and PNG")
    args = parser.parse_args()
    from vllm_specplug.cli.main import main as cli
    from vllm_specplug.models.heads import build_head

    model = args.model or str(build_head("tiny-mtp"))
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["bench", "offline", "--model", model,
                "--prompts", str(chat_prompts_file(args.num_prompts, Path(tmp))),
                "--batch-sizes", *map(str, args.batch_sizes), "--repeats", str(args.repeats),
                "--max-tokens", str(args.max_tokens), "--dtype", "float32"]
        argv += [f"--spec={name}={json.dumps(config)}"
                 for name, config in specs(args.draft_temperatures).items()]
        if args.out:
            argv += ["--out", args.out]
        cli(argv)


if __name__ == "__main__":
    main()
