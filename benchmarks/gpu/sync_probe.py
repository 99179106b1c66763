"""Where a Model Runner V2 step makes the host wait for the GPU (a
diagnostic, for issue 26: our first step of a wave took 1.5x vLLM's
`eagle3`'s at batch 16 and 64 on the H100, docs/results/smollm2_bestk_b16_64_h100_s69).

Under async scheduling the host prepares step n+1 while the GPU runs step
n. An operation that synchronises (a blocking copy from pageable memory, a
`.item()`, a boolean-mask index, `nonzero`) holds the host until the GPU's
queue has drained: the host work after it no longer hides under the GPU's.
PyTorch can report each one (`torch.cuda.set_sync_debug_mode("warn")`).
This script turns that on around the runner's `execute_model` and
`sample_tokens` (after start-up and one warm-up pass: capture syncs by
design) and counts every report by step kind (`bench/step_kinds.py`:
`first`, `mixed`, `decode`) and by the Python line that made it, with its
caller frames in vLLM and vllm-specplug.

    python3 benchmarks/gpu/sync_probe.py --head DIR [--rows vllm-eagle3-K5,ours-chain-K5,ours-tree16]
        [--batch-size 16] [--num-prompts 32] [--max-tokens 64] [--model smollm2|DIR]

One engine per row, one after the other, in this process (the patch needs
the worker here). JSON to $OUT/sync_probe.json, a table on stdout.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process

SYNC_MESSAGE = "synchroniz"  # PyTorch's report: "called a synchronizing CUDA operation"
OWN_PATHS = ("vllm_specplug", "/vllm/")  # caller frames worth keeping
NUM_CALLER_FRAMES = 4


def row_specs(head: str) -> dict[str, dict]:
    """The rows `bench offline` compares (v2_tree_runs.sh ROWS=bestk-all)."""
    ours = {"method": "specplug_eagle3", "model": head}
    return {"vllm-eagle3-K5": {"method": "eagle3", "model": head, "num_speculative_tokens": 5},
            "ours-chain-K5": {**ours, "topk": 1, "num_steps": 5},
            "ours-tree16": {**ours, "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
                            "draft_temperature": 1.0}}


class SyncLog:
    """Reports of synchronising operations, by step kind and call site."""

    def __init__(self) -> None:
        self.armed = False
        self.kind = "start-up"
        self.num_steps: Counter = Counter()  # kind -> execute_model calls
        self.sites: dict[str, Counter] = defaultdict(Counter)  # kind -> site -> count
        self.callers: dict[str, list[str]] = {}  # site -> its first caller frames

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_MESSAGE not in str(message):
            return
        site = f"{filename}:{lineno}"
        self.sites[self.kind][site] += 1
        if site not in self.callers:
            frames = [f for f in traceback.extract_stack()[:-2]
                      if any(p in f.filename for p in OWN_PATHS)]
            self.callers[site] = [f"{f.filename}:{f.lineno} {f.name}"
                                  for f in frames[-NUM_CALLER_FRAMES:]]

    def report(self) -> dict:
        return {"num_steps": dict(self.num_steps),
                "syncs": {kind: dict(sites.most_common()) for kind, sites in self.sites.items()},
                "callers": self.callers}


class Probe:
    """The row's log the wrapped runner methods report to."""

    def __init__(self) -> None:
        self.log = SyncLog()


def probe_runner(probe: Probe) -> None:
    """Model Runner V2's two step methods with PyTorch's sync reports on
    (after our plugin's own patches of the runner, so that they are inside)."""
    import torch
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_specplug.bench.step_kinds import step_kind

    load_general_plugins()

    def wrapped(method, first: bool):
        @functools.wraps(method)
        def step(self, *args, **kwargs):
            log = probe.log
            if not log.armed:
                return method(self, *args, **kwargs)
            if first:
                log.kind = step_kind(args[0] if args else kwargs.get("scheduler_output")) \
                    or "empty"
                log.num_steps[log.kind] += 1
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return method(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return step

    GPUModelRunner.execute_model = wrapped(GPUModelRunner.execute_model, True)
    GPUModelRunner.sample_tokens = wrapped(GPUModelRunner.sample_tokens, False)


def run_row(model_dir, spec: dict, prompts, args, log: SyncLog) -> dict:
    from vllm_specplug.engine import greedy_params, make_llm, shutdown_llm

    llm = make_llm(model_dir, spec, enforce_eager=False, dtype="bfloat16",
                   gpu_memory_utilization=0.3, max_num_seqs=args.batch_size,
                   max_model_len=2048,
                   compilation_config={"max_cudagraph_capture_size": 1024})
    try:
        tokenizer = llm.get_tokenizer()
        inputs = [p.input_for(tokenizer) for p in prompts]
        params = greedy_params(args.max_tokens)
        llm.generate(inputs[:args.batch_size], params, use_tqdm=False)  # warm-up
        log.armed = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = log.show
                llm.generate(inputs, params, use_tqdm=False)
        finally:
            log.armed = False
    finally:
        shutdown_llm(llm)
    return log.report()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True, help="an EAGLE-3 head vLLM loads")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a model directory")
    parser.add_argument("--rows", default="vllm-eagle3-K5,ours-chain-K5,ours-tree16")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    from vllm_specplug.bench.sets import load_public_set

    if args.model == "smollm2":
        from vllm_specplug.models.smollm2 import build_smollm2

        model_dir = build_smollm2("bfloat16")
    else:
        model_dir = Path(args.model)
    prompts = load_public_set("mt-bench", args.num_prompts)
    specs = row_specs(args.head)
    probe, results = Probe(), {}
    probe_runner(probe)
    for name in args.rows.split(","):
        probe.log = SyncLog()
        results[name] = run_row(model_dir, specs[name], prompts, args, probe.log)
        _print(name, results[name])
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_probe.json").write_text(json.dumps(
        {"args": vars(args), "rows": results}, indent=1))


def _print(name: str, report: dict) -> None:
    print(f"== {name}: steps {report['num_steps']}")
    for kind, sites in report["syncs"].items():
        steps = report["num_steps"].get(kind, 0)
        print(f"  {kind}: {sum(sites.values())} syncs over {steps} steps")
        for site, count in list(sites.items())[:12]:
            print(f"    {count:6d}  {site}")
            for frame in report["callers"].get(site, [])[-3:]:
                print(f"              <- {frame}")


if __name__ == "__main__":
    main()
