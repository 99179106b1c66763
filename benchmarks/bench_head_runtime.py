"""Our tree drafter's head runtime alone, on this machine (no engine): per
decode step, ingest of the accepted positions of every request + one EAGLE-2
drafting pass, with the built-in `tiny-eagle3` head (or --head):

    .venv/bin/python benchmarks/bench_head_runtime.py

Compare two versions of the runtime by running this at each commit
(`PYTHONPATH=<worktree>`); docs/tree-speculation.md records such a run. On
CUDA the drafting pass replays as a captured graph unless --eager.
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = ((1, 5, 6), (4, 4, 16), (4, 8, 32))  # topk, num_steps, num_draft_tokens


def main() -> None:
    from vllm_specplug.models.heads import build_head
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", help="EAGLE-3 head dir (default: built-in tiny-eagle3)")
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--context", type=int, default=150, help="cached positions first")
    parser.add_argument("--accepted", type=int, default=3, help="positions ingested per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per shape")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    head = load_head(args.head or str(build_head("tiny-eagle3"))).to(device)
    config = head.config
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size).to(device)
    try:
        runtime = HeadRuntime(head, embed, draft_temperature=0.25, num_slots=args.batch_size,
                              cuda_graphs=device == "cuda" and not args.eager)
    except TypeError:  # a runtime from before the cache pool (comparing commits)
        runtime = HeadRuntime(head, embed, draft_temperature=0.25)
    width = len(config.aux_layer_ids) * config.target_hidden_size
    batch, req_ids = args.batch_size, [f"r{i}" for i in range(args.batch_size)]

    def ingest(start: int, count: int) -> None:
        runtime.ingest_many(req_ids, torch.randn(batch * count, width, device=device),
                            torch.randint(0, config.vocab_size, (batch * count,), device=device),
                            torch.arange(start, start + count, device=device).repeat(batch),
                            [count] * batch)

    ingest(0, args.context)
    position = args.context
    for shape in SHAPES:
        for i in range(3 + args.steps):
            if i == 3:
                if device == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
            ingest(position, args.accepted)
            position += args.accepted
            roots = torch.randint(0, config.vocab_size, (batch,), device=device)
            runtime.draft_trees(req_ids, roots, torch.full((batch,), position, device=device),
                                *shape)
        if device == "cuda":
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - started) * 1000 / args.steps
        print(f"topk {shape[0]}, {shape[1]} steps, {shape[2]} nodes, batch {batch}: "
              f"{step_ms:.2f} ms per step (ingest {args.accepted} positions + draft)",
              flush=True)


if __name__ == "__main__":
    main()
