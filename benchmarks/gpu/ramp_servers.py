"""Issue 27's mixed online load on the GPU: `vllm serve` per config, then
`bench online --ramp` over them (concurrency 1 -> 256 -> 1, servers in turn
within each repeat).

    python3 benchmarks/gpu/ramp_servers.py --work .gpu/work --out results/tiny-ramp \
        [--ramp 1 256] [--repeats 3] [--max-tokens 64] [--rows none,ours-tree16,...]

Every server serves the tiny model (fp32) with CUDA graphs, on Model Runner
V2 under async scheduling, started one at a time (vLLM's memory profiling
fails while another engine starts on the same GPU), each with a share of the
GPU's memory. Rows: no speculation, vLLM's `eagle3` at K=5 and sized by
batch (the table of `tiny-batchk`), our 16-node tree static and with our
batch policy (`"adaptive": true`). Writes `ramp.txt`, `ramp.json`,
`ramp.png` and each server's log (`logs/`) into `--out`. On the staged host
(docs/gpu.md): `bash benchmarks/gpu/v2_tree_runs.sh start tiny-ramp`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

SIZED = [[1, 4, 5], [5, 24, 3], [25, 1024, 2]]  # vLLM's table, as tiny-batchk's vllm-eagle3-sized


def row_specs(head: Path) -> dict[str, dict | None]:
    """The rows by name: None is no speculation."""
    tree = {"method": "specplug_eagle3", "model": str(head), "topk": 4, "num_steps": 4,
            "num_draft_tokens": 16, "draft_temperature": 0.25}
    eagle = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 5}
    return {"none": None, "vllm-eagle3-K5": eagle,
            "vllm-eagle3-sized": {**eagle, "num_speculative_tokens_per_batch_size": SIZED},
            "ours-tree16": tree, "ours-tree16-adaptive": {**tree, "adaptive": True}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True,
                        help="the staged work folder (tiny, tiny-eagle3, held_out.jsonl)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ramp", type=int, nargs=2, default=[1, 256], metavar=("LOW", "HIGH"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    parser.add_argument("--memory", type=float, default=0.15,
                        help="each server's --gpu-memory-utilization")
    args = parser.parse_args()
    from vllm_specplug.cli.main import main as cli
    from vllm_specplug.testing.server import SERVED_MODEL_NAME, serving

    specs = row_specs(args.work / "tiny-eagle3")
    names = args.rows.split(",") if args.rows else list(specs)
    unknown = [n for n in names if n not in specs]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; rows are {', '.join(specs)}")
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    extra = ["--gpu-memory-utilization", str(args.memory), "--max-num-seqs", "256"]
    with serving(args.work / "tiny", {n: specs[n] for n in names}, logs, extra, eager=False,
                 one_at_a_time=True, startup_seconds=600) as urls:
        return cli(["bench", "online", *[f"--url={n}={u}" for n, u in urls.items()],
                    "--model-name", SERVED_MODEL_NAME,
                    "--prompts", str(args.work / "held_out.jsonl"),
                    "--ramp", *map(str, args.ramp), "--repeats", str(args.repeats),
                    "--requests-per-client", str(args.requests_per_client),
                    "--max-tokens", str(args.max_tokens), "--out", str(args.out)])


if __name__ == "__main__":
    sys.exit(main())
