"""Tree EAGLE against chain EAGLE and no speculation, same head, one run.

Side by side on held-out chat prompts with the built-in `tiny-eagle3` head
(or --head): no speculation, vLLM's `eagle3` (chain, K), ours with topk=1
(chain, K), ours with trees at the same verified-token budget
(num_draft_tokens = K + 1, topk 2 and 4) and larger trees (16, 32, 64
nodes). A thin caller of `vllm-specplug bench offline`: prints acceptance
length, per-depth acceptance, tokens/s and the ratio to no speculation;
writes table, JSON and PNG under --out.

    .venv/bin/python benchmarks/bench_tree_eagle.py --out docs/results/tree_eagle_tiny
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

K = 3
TREES = {  # name: (topk, num_steps, num_draft_tokens)
    f"ours-chain-k{K}": (1, K, K + 1),
    f"ours-tree{K + 1}-topk2": (2, K, K + 1),
    f"ours-tree{K + 1}-topk4": (4, K, K + 1),
    "ours-tree16-topk4": (4, 4, 16),
    "ours-tree32-topk4": (4, 8, 32),
    "ours-tree64-topk8": (8, 8, 64),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default=None, help="EAGLE-3 head dir (default: tiny-eagle3)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[24])
    parser.add_argument("--repeats", type=int, default=1)
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


def specs(head: str) -> dict[str, dict]:
    out = {f"vllm-eagle3-k{K}": {"method": "eagle3", "model": head,
                                 "num_speculative_tokens": K}}
    for name, (topk, steps, nodes) in TREES.items():
        out[name] = {"method": "specplug_eagle3", "model": head, "topk": topk,
                     "num_steps": steps, "num_draft_tokens": nodes}
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
                "--max-tokens", str(args.max_tokens)]
        argv += [f"--spec={name}={json.dumps(config)}" for name, config in specs(head).items()]
        if args.out:
            argv += ["--out", args.out]
        cli(argv)


if __name__ == "__main__":
    main()
