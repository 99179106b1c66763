"""Where a Model Runner V2 step makes the host wait for the GPU (a
diagnostic, for issue 26: our first step of a wave took 1.5x vLLM's
`eagle3`'s at batch 16 and 64 on the H100, docs/results/smollm2_bestk_b16_64_h100_s69).

Under async scheduling the host prepares step n+1 while the GPU runs step
n. An operation that synchronises (a blocking copy from pageable memory, a
`.item()`, a boolean-mask index, `nonzero`) holds the host until the GPU's
queue has drained: the host work after it no longer hides under the GPU's.
PyTorch can report each one (`torch.cuda.set_sync_debug_mode("warn")`).
This script turns that on in the worker after start-up and one warm-up
pass (capture syncs by design; `vllm_specplug.testing.host_syncs` through
the worker probe's RPCs) and counts every report by step kind
(`bench/step_kinds.py`: `first`, `mixed`, `decode`) and by the Python line
that made it, with its caller frames in vLLM and vllm-specplug.

    python3 benchmarks/gpu/sync_probe.py --head DIR [--rows vllm-eagle3-K5,ours-chain-K5,ours-tree16]
        [--batch-size 16] [--num-prompts 32] [--max-tokens 64] [--model smollm2|DIR]
        [--set mt-bench|mt-bench-json]

One engine per row, one after the other. JSON to $OUT/sync_probe.json, a
table on stdout. Under a schema (`--set mt-bench-json`) the grammar's
reads of the drafts and outputs are waits by design (`bench offline
--phases`' `grammar_wait`); the probe shows where they are and any other.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def row_specs(head: str) -> dict[str, dict]:
    """The rows `bench offline` compares (v2_tree_runs.sh ROWS=bestk-all)."""
    ours = {"method": "specplug_eagle3", "model": head}
    return {"vllm-eagle3-K5": {"method": "eagle3", "model": head, "num_speculative_tokens": 5},
            "ours-chain-K5": {**ours, "topk": 1, "num_steps": 5},
            "ours-tree16": {**ours, "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
                            "draft_temperature": 1.0}}


def run_row(model_dir, spec: dict, prompts, args) -> dict:
    from vllm_specplug.bench.prompts import sampling_params_for
    from vllm_specplug.engine import greedy_params, make_llm, shutdown_llm
    from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

    llm = make_llm(model_dir, spec, enforce_eager=False, dtype="bfloat16",
                   gpu_memory_utilization=0.3, max_num_seqs=args.batch_size,
                   max_model_len=2048, worker_extension_cls=PROBE_QUALNAME,
                   compilation_config={"max_cudagraph_capture_size": 1024})
    try:
        tokenizer = llm.get_tokenizer()
        inputs = [p.input_for(tokenizer) for p in prompts]
        # under a set's JSON schemas (mt-bench-json) each prompt is held to its own
        params = sampling_params_for(prompts, greedy_params(args.max_tokens))
        warm_up = params[:args.batch_size] if isinstance(params, list) else params
        llm.generate(inputs[:args.batch_size], warm_up, use_tqdm=False)  # capture syncs by design
        llm.collective_rpc("specplug_watch_syncs")
        llm.generate(inputs, params, use_tqdm=False)
        return llm.collective_rpc("specplug_syncs")[0]
    finally:
        shutdown_llm(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True, help="an EAGLE-3 head vLLM loads")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a model directory")
    parser.add_argument("--rows", default="vllm-eagle3-K5,ours-chain-K5,ours-tree16")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--set", default="mt-bench",
                        help="a public prompt set (mt-bench-json: under its JSON schemas)")
    args = parser.parse_args()
    from vllm_specplug.bench.sets import load_public_set

    if args.model == "smollm2":
        from vllm_specplug.models.smollm2 import build_smollm2

        model_dir = build_smollm2("bfloat16")
    else:
        model_dir = Path(args.model)
    prompts = load_public_set(args.set, args.num_prompts)
    specs = row_specs(args.head)
    results = {}
    for name in args.rows.split(","):
        results[name] = run_row(model_dir, specs[name], prompts, args)
        _print(name, results[name])
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_probe.json").write_text(json.dumps(
        {"args": vars(args), "rows": results}, indent=1))


def _print(name: str, report: dict) -> None:
    print(f"== {name}: steps {report['num_steps']}; of ours: {report['ours'] or 'none'}; "
          f"the probe's own: {report.get('probe', 0)}")
    for kind, sites in report["syncs"].items():
        steps = report["num_steps"].get(kind, 0)
        print(f"  {kind}: {sum(sites.values())} syncs over {steps} steps")
        for site, count in list(sites.items())[:12]:
            print(f"    {count:6d}  {site}")
            for frame in report["callers"].get(site, [])[-3:]:
                print(f"              <- {frame}")


if __name__ == "__main__":
    main()
