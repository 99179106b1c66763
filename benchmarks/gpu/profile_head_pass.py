"""Which GPU kernels a drafting pass of the head runtime spends its time in:
one eager pass per (batch, tree shape) under the PyTorch profiler, for a
trained head directory, no engine. Kernels are grouped by name; the table
gives their count and total GPU microseconds, so the pass's kernel budget
(launches inside a captured graph cost GPU time even when tiny) shows
where fusing would pay.

    python3 benchmarks/gpu/profile_head_pass.py --head DIR --out $OUT

Writes `head_pass_kernels.json` (every row) and prints the top kernels.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))


def profile_pass(runtime, slots, roots, positions, num_keys: int, shape) -> dict:
    """{"kernels": [{name, count, gpu_us}], "num_kernels", "gpu_us"} of one pass."""
    import torch

    runtime.draft_slots(slots, roots, positions, num_keys, *shape)  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runtime.draft_slots(slots, roots, positions, num_keys, *shape)
        torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]][0] += 1
            totals[event.name[:90]][1] += event.device_time_total
    kernels = sorted(({"name": n, "count": c, "gpu_us": t} for n, (c, t) in totals.items()),
                     key=lambda k: -k["gpu_us"])
    return {"kernels": kernels, "num_kernels": sum(k["count"] for k in kernels),
            "gpu_us": sum(k["gpu_us"] for k in kernels)}


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench_head_passes import head_config
    from vllm_specplug.proposers.draft_layers import cast_parameters
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", type=Path, required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--shapes", nargs="+", default=["4,4,16", "4,4,6", "2,2,3", "1,2,3"],
                        help="topk,num_steps,num_draft_tokens of each pass")
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    config = head_config(args.head)
    head = cast_parameters(load_head(args.head).cuda(), torch.bfloat16)
    embed = torch.nn.Embedding(config["vocab_size"], config["hidden_size"]).cuda().bfloat16()
    runtime = HeadRuntime(head, embed, num_slots=max(args.batch_sizes))
    aux = len(config["aux_layer_ids"]) * config["target_hidden_size"]
    rows = []
    for batch in args.batch_sizes:
        ids = [f"r{b}" for b in range(batch)]
        context = torch.arange(args.context, device="cuda")
        runtime.ingest_many(ids, torch.randn(batch * args.context, aux, device="cuda"),
                            torch.randint(0, 1000, (batch * args.context,), device="cuda"),
                            context.repeat(batch), [args.context] * batch)
        slots = torch.tensor([runtime.pool.slot_of[r] for r in ids], device="cuda")
        roots = torch.zeros(batch, dtype=torch.long, device="cuda")
        positions = torch.full((batch,), args.context, device="cuda")
        for text in args.shapes:
            shape = tuple(int(x) for x in text.split(","))
            row = {"batch_size": batch, "shape": shape,
                   **profile_pass(runtime, slots, roots, positions, args.context + 1, shape)}
            rows.append(row)
            print(f"batch {batch} shape {shape}: {row['num_kernels']} kernels, "
                  f"{row['gpu_us']:.0f} us GPU; top: " + "; ".join(
                      f"{k['name'][:40]} x{k['count']} {k['gpu_us']:.0f}us"
                      for k in row["kernels"][:6]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_pass_kernels.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
