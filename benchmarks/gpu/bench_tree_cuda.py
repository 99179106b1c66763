"""Tree EAGLE on a CUDA GPU (issue 15): lossless runs on the tiny model, and
step costs on a Llama-3-8B-shaped target.

Here (CPU, built-in models cached):

    .venv/bin/python benchmarks/gpu/bench_tree_cuda.py prepare --work .gpu/work

adds the built-in EAGLE-3 head (`tiny-eagle3`) and the tiny target with an
MTP layer (`tiny-mtp`, tests/gpu/test_mtp_cuda.py) to the work folder of
`bench_model_runner_v2.py prepare`. On the staged GPU host (docs/gpu.md):

    python3 benchmarks/gpu/bench_tree_cuda.py tiny  --work .gpu/work --results R
    python3 benchmarks/gpu/bench_tree_cuda.py costs --work .gpu/work --results R

`tiny`: one engine per method (no speculation, vLLM's eagle3 K=5, ours as a
chain K=5, ours as trees of 16 and 32 nodes), 60 held-out prompts in one batch
and each alone, 64 greedy tokens, fp32 (vLLM picks its Triton attention
backend); outputs compared token for token with no speculation, acceptance,
tokens/s, and our per-phase times (integration/v1/tree_profile.py).

`costs`: a Llama-3-8B-shaped target (dummy bf16 weights, FlashAttention) and
an EAGLE-3 head of the matching shape with random weights (only its cost
matters). Plain decode step time at batch 1/16/64 (from two generation
lengths, so prefill cancels), then one `specplug_eagle3` engine (64-node trees:
topk 8, 8 steps) whose verification is cut to chains of 2..9 and trees of
8..64 nodes by the probe (`specplug_tree_draft_shape`), with per-phase times
of every decode step; `--parts configs`: one engine per real configuration
(chain K=5, trees of 16 and 32 nodes) at its own capture sizes, drafting
with graphed passes. `report` (benchmarks/gpu/tree_cost_model.py) turns the
JSON into tables, the cost model and plots.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_runner_v2 import LLAMA3_8B  # noqa: E402
from bench_tree_head import BATCH_SIZES, HEAD_8B, head_steps  # noqa: E402

NUM_PROMPTS, MAX_TOKENS = 60, 64
CHAIN_NODES = tuple(range(2, 10))  # K = 1..8
TREE_NODES = (8, 16, 32, 64)
COST_TREE = {"topk": 8, "num_steps": 8, "num_draft_tokens": 64}
PLAIN_LENGTHS = (16, 80)  # two generation lengths: prefill cancels in the difference
SWEEP_TOKENS = 12
MS = 1000.0


def tiny_methods(head: str) -> dict[str, dict | None]:
    ours = {"method": "specplug_eagle3", "model": head}
    return {
        "none": None,
        "vllm eagle3 K=5": {"method": "eagle3", "model": head, "num_speculative_tokens": 5},
        "ours chain K=5": {**ours, "topk": 1, "num_steps": 5, "num_draft_tokens": 6},
        # per-position acceptance of K=8 gives the chain's acceptance at every K <= 8
        "ours chain K=8": {**ours, "topk": 1, "num_steps": 8, "num_draft_tokens": 9},
        **{f"ours tree {n}": {**ours, "topk": topk, "num_steps": steps, "num_draft_tokens": n,
                              "draft_temperature": 0.25}
           for n, topk, steps in ((8, 4, 4), (16, 4, 4), (32, 4, 8), (64, 8, 8))},
    }


# enough for batch 256 (v2_tree_runs.sh tiny-batchk, issue 27)
HELD_OUT_PROMPTS = 320


def prepare(work: Path) -> None:
    from vllm_specplug.bench.prompts import write_bench_prompts
    from vllm_specplug.models import held_out_prompts
    from vllm_specplug.models.heads import build_head

    for name in ("tiny-eagle3", "tiny-mtp"):
        shutil.copytree(build_head(name), work / name, dirs_exist_ok=True)
    # the held-out prompts as a bench file (`host.sh tiny-bench`)
    write_bench_prompts(work / "held_out.jsonl", held_out_prompts(HELD_OUT_PROMPTS))
    print(f"wrote {work}/tiny-eagle3, {work}/tiny-mtp and {work}/held_out.jsonl")


def _engine(model, spec, **kwargs):
    from vllm_specplug.engine import make_llm
    from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

    return make_llm(model, spec, enforce_eager=False, worker_extension_cls=PROBE_QUALNAME,
                    cudagraph_metrics=True, max_num_seqs=64, **kwargs)


def _profile(llm, enable: bool | None = None) -> list[dict]:
    return llm.collective_rpc("specplug_tree_profile", args=(enable,))[0]


PROFILED_ALONE = 10  # prompts run alone again with the phase profiler on


def _generate(llm, prompts, params, mode: str) -> tuple[list[list[int]], float]:
    """Token ids and seconds of the prompts in one batch or one at a time."""
    from vllm_specplug.engine import generate

    if mode == "batched":
        result = generate(llm, prompts, params)
        return result.token_ids, result.seconds
    results = [generate(llm, [p], params) for p in prompts]
    return [r.token_ids[0] for r in results], sum(r.seconds for r in results)


def run_tiny_method(work: Path, name: str, spec, prompts) -> dict:
    from vllm_specplug.engine import generate, greedy_params, shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    ours = spec is not None and spec["method"].startswith("specplug")
    llm = _engine(work / "tiny", spec, dtype="float32", gpu_memory_utilization=0.3,
                  compilation_config={"max_cudagraph_capture_size": 2048})
    try:
        params = greedy_params(MAX_TOKENS)
        generate(llm, prompts[:2], greedy_params(8))  # warm-up
        llm.collective_rpc("specplug_record_cudagraph_modes")
        row = {"method": name, "spec": spec}
        for mode in ("batched", "alone"):
            before = read_spec_decode_counts(llm)
            token_ids, seconds = _generate(llm, prompts, params, mode)
            counts = read_spec_decode_counts(llm) - before
            row[mode] = {"token_ids": token_ids, "seconds": seconds,
                         "tokens_per_second": sum(map(len, token_ids)) / seconds,
                         "counts": counts.as_dict(), "phases": []}
        row["cudagraph_modes"] = llm.collective_rpc("specplug_cudagraph_modes")[0]
        if ours:  # phases in passes of their own: a profiled step syncs at every mark
            _profile(llm, True)
            for mode, count in (("batched", len(prompts)), ("alone", PROFILED_ALONE)):
                _generate(llm, prompts[:count], params, mode)
                row[mode]["phases"] = _profile(llm)
            _profile(llm, False)
        if spec is None:
            from vllm_specplug.bench.compare import top2_gaps
            outputs = llm.generate(prompts, greedy_params(MAX_TOKENS, logprobs=2),
                                   use_tqdm=False)
            row["gaps"] = top2_gaps(outputs)
        return row
    finally:
        shutdown_llm(llm)


def tiny(work: Path, results: Path, names: list[str]) -> None:
    """Runs the methods named (all by default; "none" first when absent from
    the results, since every row is compared with it), adding to the JSON."""
    from tqdm import tqdm

    ids = json.loads((work / "prompts_tiny.json").read_text())[:NUM_PROMPTS]
    prompts = [{"prompt_token_ids": p} for p in ids]
    methods = tiny_methods(str(work / "tiny-eagle3"))
    path = results / "tree_tiny.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    done = {r["method"] for r in rows}
    todo = [n for n in methods if (not names or n in names or (n == "none" and not done))
            and n not in done]
    for name in tqdm(todo, desc="tiny engines"):
        rows.append(run_tiny_method(work, name, methods[name], prompts))
        _save(path, rows)
        print(summary_line(rows[0], rows[-1]), flush=True)


def summary_line(base: dict, row: dict) -> str:
    parts = [row["method"]]
    for mode in ("batched", "alone"):
        same = sum(a == b for a, b in zip(base[mode]["token_ids"], row[mode]["token_ids"]))
        counts = row[mode]["counts"]
        accept = 1 + counts["num_accepted_tokens"] / max(counts["num_drafts"], 1)
        parts.append(f"{mode}: {row[mode]['tokens_per_second']:.0f} tok/s, "
                     f"{same}/{len(base[mode]['token_ids'])} equal, accept {accept:.2f}")
    return " | ".join(parts)


def _save(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))


def build_8b(work: Path) -> tuple[Path, Path]:
    """The 8B-shaped config and a random EAGLE-3 head of its shape."""
    import torch

    from vllm_specplug.draft_models.eagle3_model import Eagle3Head, HeadConfig

    target = work / "llama3-8b-shape"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(LLAMA3_8B))
    head_dir = work / "llama3-8b-eagle3-random"
    if not (head_dir / "model.safetensors").exists():
        head = Eagle3Head(HeadConfig(**HEAD_8B))
        head.reset_parameters(torch.Generator().manual_seed(0))
        head.save_pretrained(head_dir)
    return target, head_dir


def prompts_8b(count: int) -> list[dict]:
    import random

    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(1000, 1400) for _ in range(512)]}
            for _ in range(count)]


ENGINE_8B = dict(dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                 max_model_len=1024, max_num_batched_tokens=8192, gpu_memory_utilization=0.85)


def plain_steps(target: Path, prompts) -> list[dict]:
    """Decode step time without speculation: (t(long) - t(short)) / extra tokens."""
    from vllm_specplug.engine import generate, greedy_params, shutdown_llm

    llm = _engine(target, None, **ENGINE_8B)
    try:
        generate(llm, prompts[:1], greedy_params(4))
        rows = []
        for batch in BATCH_SIZES:
            # prompts cached first, so both timed runs skip the same prefill
            generate(llm, prompts[:batch], greedy_params(1))
            times = [generate(llm, prompts[:batch], greedy_params(n, ignore_eos=True)).seconds
                     for n in PLAIN_LENGTHS]
            step = (times[1] - times[0]) / (PLAIN_LENGTHS[1] - PLAIN_LENGTHS[0])
            rows.append({"batch_size": batch, "step_s": step})
            print(f"  plain decode batch {batch}: {1000 * step:.2f} ms/step", flush=True)
        return rows
    finally:
        shutdown_llm(llm)


def sweep_steps(target: Path, head: Path, prompts) -> list[dict]:
    """Per-phase times of decode steps verifying chains and trees of n nodes."""
    from tqdm import tqdm

    from vllm_specplug.engine import generate, greedy_params, shutdown_llm

    spec = {"method": "specplug_eagle3", "model": str(head), **COST_TREE}
    # graphs up to 64 requests x 64 nodes (vLLM's default stops at 512 tokens)
    # leave the head room to draft for 64 requests (0.85 ran out of memory there)
    llm = _engine(target, spec, compilation_config={"max_cudagraph_capture_size": 4096},
                  **{**ENGINE_8B, "gpu_memory_utilization": 0.6})
    shapes = [(n, True) for n in CHAIN_NODES] + [(n, False) for n in TREE_NODES]
    rows = []
    try:
        generate(llm, prompts[:1], greedy_params(4))
        for (num_nodes, chain), batch in tqdm([(s, b) for s in shapes for b in BATCH_SIZES],
                                              desc="verify shapes"):
            llm.collective_rpc("specplug_tree_draft_shape", args=(num_nodes, chain))
            _profile(llm, True)
            generate(llm, prompts[:batch], greedy_params(SWEEP_TOKENS, ignore_eos=True))
            steps = [r for r in _profile(llm, False) if r["num_tokens"] == batch * num_nodes]
            rows.append(shape_row(num_nodes, chain, batch, steps))
        rows.append({"cudagraph_capture_sizes": llm.collective_rpc(
            "specplug_runner_state")[0]["cudagraph_capture_sizes"]})
        return rows
    finally:
        shutdown_llm(llm)


ENGINE_CONFIGS = {  # name -> (tree options, nodes verified): one engine each
    "chain K=5": ({"topk": 1, "num_steps": 5, "num_draft_tokens": 6}, 6),
    "tree 16": ({"topk": 4, "num_steps": 4, "num_draft_tokens": 16}, 16),
    "tree 32": ({"topk": 4, "num_steps": 8, "num_draft_tokens": 32}, 32),
}


def _torch_profile(llm, prompts) -> dict:
    """torch's profiler over one more short run (where a step's time goes,
    kernel by kernel); its times include the profiler's overhead."""
    from vllm_specplug.engine import generate, greedy_params

    llm.collective_rpc("specplug_torch_profile", args=(True,))
    generate(llm, prompts, greedy_params(4, ignore_eos=True))
    profile = llm.collective_rpc("specplug_torch_profile", args=(False,))[0]
    print(profile["table"][:3000], flush=True)
    return profile


def config_steps(target: Path, head: Path, prompts, names: list[str]) -> list[dict]:
    """Per-phase times of decode steps of one engine per configuration, so
    each verifies at its own CUDA-graph capture sizes (multiples of its node
    count) and drafts with its own shape (graphed drafting passes)."""
    from vllm_specplug.engine import generate, greedy_params, shutdown_llm

    rows = []
    for name in names:
        options, nodes = ENGINE_CONFIGS[name]
        spec = {"method": "specplug_eagle3", "model": str(head), **options}
        llm = _engine(target, spec, compilation_config={
            "max_cudagraph_capture_size": nodes * max(BATCH_SIZES)},
            **{**ENGINE_8B, "gpu_memory_utilization": 0.6})
        try:
            generate(llm, prompts[:1], greedy_params(4))
            for batch in BATCH_SIZES:
                generate(llm, prompts[:batch], greedy_params(4))  # captures drafting graphs
                _profile(llm, True)
                generate(llm, prompts[:batch], greedy_params(SWEEP_TOKENS, ignore_eos=True))
                steps = [r for r in _profile(llm, False) if r["num_tokens"] == batch * nodes]
                rows.append({**shape_row(nodes, options["topk"] == 1, batch, steps),
                             "config": name, "torch_profile": _torch_profile(llm, prompts[:batch])})
        finally:
            shutdown_llm(llm)
    return rows


def shape_row(num_nodes: int, chain: bool, batch: int, steps: list[dict]) -> dict:
    median = lambda key: (statistics.median(s[key] for s in steps if s[key] is not None)
                          if any(s[key] is not None for s in steps) else None)
    row = {"num_nodes": num_nodes, "shape": "chain" if chain else "tree",
           "batch_size": batch, "num_steps": len(steps),
           **{key: median(key) for key in ("forward_s", "verify_s", "draft_s", "step_s")}}
    print(f"  {row['shape']} {num_nodes} batch {batch}: "
          + ", ".join(f"{k} {1000 * row[k]:.2f} ms" for k in
                      ("forward_s", "verify_s", "draft_s", "step_s") if row[k] is not None),
          flush=True)
    return row


def costs(work: Path, results: Path, parts: list[str], configs: list[str]) -> None:
    """`parts`: "plain", "sweep", "head", "configs" (each fits one 10-minute
    device call; "configs" one or two engines per call, `configs` names them)."""
    target, head = build_8b(work)
    prompts = prompts_8b(max(BATCH_SIZES))
    path = results / "tree_costs_8b.json"
    run = json.loads(path.read_text())[0] if path.exists() else {}
    for part in parts:
        started = time.perf_counter()
        rows = {"plain": lambda: plain_steps(target, prompts),
                "sweep": lambda: sweep_steps(target, head, prompts),
                "head": lambda: head_steps(head),
                "configs": lambda: config_steps(target, head, prompts, configs)}[part]()
        if part == "configs":  # one call per engine or two: keep the others' rows
            rows = [r for r in run.get("configs", []) if r["config"] not in configs] + rows
        run[part] = rows
        run[f"{part}_seconds"] = time.perf_counter() - started
        _save(path, [run])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["prepare", "tiny", "costs"])
    parser.add_argument("--work", type=Path, default=Path(".gpu/work"))
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--methods", nargs="*", default=[],
                        help="tiny: a subset of " + ", ".join(tiny_methods("HEAD")))
    parser.add_argument("--parts", nargs="*", default=["plain", "sweep", "head"],
                        choices=["plain", "sweep", "head", "configs"],
                        help="costs: which measurements to run (head: no engine)")
    parser.add_argument("--configs", nargs="*", default=list(ENGINE_CONFIGS),
                        choices=list(ENGINE_CONFIGS),
                        help="costs --parts configs: one engine per configuration")
    args = parser.parse_args()
    unknown = set(args.methods) - set(tiny_methods("HEAD"))
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}")
    if args.step == "prepare":
        prepare(args.work)
    elif args.step == "tiny":
        tiny(args.work, args.results, args.methods)
    else:
        costs(args.work, args.results, args.parts, args.configs)


if __name__ == "__main__":
    main()
