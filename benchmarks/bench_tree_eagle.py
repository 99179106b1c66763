"""Tree EAGLE against chain EAGLE and no speculation, same head, one run.

Side by side on held-out chat prompts with the built-in `tiny-eagle3` head
(or --head): no speculation, vLLM's `eagle3` (chain, K = 3 and 5), ours
with topk=1 (chain, same K), ours with trees at the same verified-token
budget (num_draft_tokens = K + 1) and larger trees (16, 32, 64 nodes), each
tree at draft_temperature 1 (EAGLE-2 as published) and 0.25 (the head's
scores sharpened before selection; lossless either way). A thin caller of `vllm-specplug bench offline`: prints acceptance
length, per-depth acceptance, tokens/s and the ratio to no speculation;
writes table, JSON and PNG under --out.

    .venv/bin/python benchmarks/bench_tree_eagle.py --out docs/results/tree_eagle_tiny
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

CHAINS = (3, 5)  # K of the chains (vLLM's eagle3 and ours with topk=1)
TREES = {  # name: (topk, num_steps, num_draft_tokens)
    "tree4-topk2": (2, 3, 4),  # the verified-token budget of the K=3 chain
    "tree4-topk4": (4, 3, 4),
    "tree6-topk2": (2, 5, 6),  # the budget of the K=5 chain
    "tree16-topk4": (4, 4, 16),
    "tree32-topk4": (4, 8, 32),
    "tree64-topk8": (8, 8, 64),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default=None, help="EAGLE-3 head dir (default: tiny-eagle3)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[24])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--draft-temperatures", type=float, nargs="+", default=[1.0, 0.25],
                        help="tree runs per draft_temperature (selection calibration)")
    parser.add_argument("--out", default=None, help="directory for table, JSON and PNG")
    return parser.parse_args()


def chat_prompts_file(num_prompts: int, directory: Path) -> Path:
    from vllm_specplug.models import held_out_prompts
    from vllm_specplug.models.corpus import chat_conversations

    path = directory / "held_out_chat.jsonl"
    with path.open("w") as handle:
        for conversation in chat_conversations(held_out_prompts(num_prompts)):
            handle.write(json.dumps({"messages": conversation["messages"]}) + "\n")
    return path


def specs(head: str, temperatures: list[float]) -> dict[str, dict]:
    out = {}
    for k in CHAINS:
        out[f"vllm-eagle3-k{k}"] = {"method": "eagle3", "model": head,
                                    "num_speculative_tokens": k}
        out[f"ours-chain-k{k}"] = {"method": "specplug_eagle3", "model": head, "topk": 1,
                                   "num_steps": k}
    for temperature in temperatures:
        for name, (topk, steps, nodes) in TREES.items():
            out[f"ours-{name}-T{temperature:g}"] = {
                "method": "specplug_eagle3", "model": head, "topk": topk, "num_steps": steps,
                "num_draft_tokens": nodes, "draft_temperature": temperature}
    return out


def main() -> None:
    args = parse_args()
    from vllm_specplug.cli.main import main as cli
    from vllm_specplug.models.heads import build_head

    head = args.head or str(build_head("tiny-eagle3"))
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["bench", "offline", "--model", "tiny",
                "--prompts", str(chat_prompts_file(args.num_prompts, Path(tmp))),
                "--batch-sizes", *map(str, args.batch_sizes), "--repeats", str(args.repeats),
                "--max-tokens", str(args.max_tokens), "--dtype", "float32"]
        argv += [f"--spec={name}={json.dumps(config)}" for name, config in specs(head, args.draft_temperatures).items()]
        if args.out:
            argv += ["--out", args.out]
        cli(argv)


if __name__ == "__main__":
    main()
