"""The head runtime's passes alone (no engine), for a trained head directory:
a decode ingest and a whole drafting pass, eager and replayed as CUDA graphs,
at a few batch sizes and draft shapes (`bench_tree_head.head_steps`).

Run it twice in one lease to compare two versions of the runtime: the
working tree, and an older package put first on `PYTHONPATH` (with its own
`bench_tree_head.py` beside it), e.g.

    git archive HEAD~1 vllm_specplug benchmarks/gpu/bench_tree_head.py | tar -x -C .gpu/old
    PYTHONPATH=.gpu/old:.gpu/old/benchmarks/gpu:$PYTHONPATH python3 \
        benchmarks/gpu/bench_head_passes.py --head DIR --label before --json before.json
    python3 benchmarks/gpu/bench_head_passes.py --head DIR --label after --json after.json

Or compare the runtime's two attention paths in one process, interleaved
(`--attention torch triton --repeats 2`: the einsums over copied keys, the
kernel reading the pool in place; `proposers/head_attention.py`).

Prints one line per (batch, shape): ingest and drafting-pass milliseconds.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# bench_tree_head from this directory unless PYTHONPATH names another first
# (Python puts a script's own directory first: move it last)
_HERE = str(Path(__file__).resolve().parent)
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)] + [_HERE]


def head_config(head_dir: Path) -> dict:
    """What `head_steps` reads of a head's shape, from its config.json."""
    raw = json.loads((head_dir / "config.json").read_text())
    ours = raw.get("specplug_head_config", {})
    config = {**raw, **ours}
    config.setdefault("aux_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", type=Path, required=True, help="a trained head directory")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--shapes", nargs="+", default=["1,5,6", "4,4,16"],
                        help="topk,num_steps,num_draft_tokens of each drafting pass")
    parser.add_argument("--context", type=int, default=384, help="cached positions per request")
    parser.add_argument("--attention", nargs="+", default=["auto"],
                        choices=["auto", "torch", "triton"],
                        help="the head's attention paths to time, in turn each repeat")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over --attention")
    parser.add_argument("--label", default="", help="names this run in the output")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)

    import bench_tree_head

    bench_tree_head.HEAD_CONFIGS = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    print(f"bench_tree_head from {bench_tree_head.__file__}", flush=True)
    rows = []
    for repeat in range(args.repeats):
        for attention in args.attention:
            print(f"repeat {repeat}, attention {attention}", flush=True)
            run = bench_tree_head.head_steps(args.head, head_config(args.head),
                                             batch_sizes=tuple(args.batch_sizes),
                                             context_len=args.context,
                                             attention_backend=attention)
            rows += [{**row, "label": args.label, "repeat": repeat} for row in run]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
