"""Our model-free proposers under vLLM's Model Runner V2 on a CUDA GPU, side
by side with no speculation and vLLM's own n-gram and suffix decoding.

Two steps. Here (CPU, with the built-in models cached):

    .venv/bin/python benchmarks/gpu/bench_model_runner_v2.py prepare --work .gpu/work

writes the built-in tiny model and 136 held-out prompts (token ids) under
`--work`. On the staged GPU host (docs/gpu.md), carrying `.gpu/work`:

    python3 benchmarks/gpu/bench_model_runner_v2.py run --work .gpu/work \\
        --results $HOME/results --out $OUT [--targets tiny] [--methods none ...]

runs, per target, one engine per method and batch sizes 1, 16 and 64 in it,
each batch size on its own prompts (suffix decoding's global cache would
otherwise meet prompts it has already answered): the tiny model (real
acceptance, fp32) and a Llama-3-8B-shaped target with dummy weights (real step
costs, bf16; its text is repetitive, so its acceptance shows mechanism, not a
realistic speed-up). Each (target, method) lands as JSON in `--results`, so a
run split over several calls on one host is reported as one table: tokens/s,
the ratio to no speculation, mean acceptance length (1 + accepted / drafts,
vLLM's metric), tokens per decode step per request (which counts steps
without a draft too), the runner, speculator and scheduler each engine ran,
the share of decode-sized steps that replayed a FULL CUDA graph, and whether
every output equals no speculation's. Writes text, JSON and PNG to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

K = 5
NGRAM = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
HYBRID = {"proposers": [{"method": "specplug_suffix", "min_token_prob": 0.2},
                        {"method": "specplug_ngram", "prompt_lookup_max": 5}]}
VARIABLE = {"scheduler_cls": "vllm_specplug.integration.scheduler.SpecplugAsyncScheduler"}
HOST = {"VLLM_SPECPLUG_HOST_DRAFTING": "1"}


@dataclass(frozen=True)
class Method:
    spec: dict | None                                   # speculative_config (None: none)
    engine: dict = field(default_factory=dict)          # extra vllm.LLM arguments
    env: dict = field(default_factory=dict)             # environment of the engine


OURS_NGRAM = {"method": "specplug_ngram", "num_speculative_tokens": K, **NGRAM}
OURS_SUFFIX = {"method": "specplug_suffix", "num_speculative_tokens": K}
METHODS: dict[str, Method] = {
    "none": Method(None),
    "vllm ngram": Method({"method": "ngram", "num_speculative_tokens": K, **NGRAM}),
    # vLLM's GPU n-gram under its other name, with which vLLM turns async scheduling on
    "vllm ngram_gpu": Method({"method": "ngram_gpu", "num_speculative_tokens": K, **NGRAM}),
    "specplug_ngram": Method(OURS_NGRAM),                     # device drafting, async
    "specplug_ngram sync": Method(OURS_NGRAM, {"async_scheduling": False}),
    "specplug_ngram host": Method(OURS_NGRAM, env=HOST),      # host drafting, K slots
    "specplug_ngram host variable": Method(OURS_NGRAM, VARIABLE, HOST),
    "vllm suffix": Method({"method": "suffix", "num_speculative_tokens": K}),
    "specplug_suffix": Method(OURS_SUFFIX),
    "specplug_suffix variable": Method(OURS_SUFFIX, VARIABLE),
    "specplug_hybrid": Method({"method": "specplug_hybrid", "num_speculative_tokens": K,
                               **HYBRID}),
}
BATCH_SIZES = (1, 16, 64)
# Distinct prompts per batch size and target (suffix decoding's global cache
# must never meet a prompt twice); the tiny model's steps are short, so it
# gets more of them to measure over.
NUM_PROMPTS = {"tiny": {1: 24, 16: 192, 64: 192}, "llama3-8b-shape": {1: 8, 16: 64, 64: 128}}
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000,
             "eos_token_id": 128001, "tie_word_embeddings": False}


def prepare(work: Path) -> None:
    from transformers import AutoTokenizer

    from vllm_specplug.models import build_model, held_out_prompts

    shutil.copytree(build_model("tiny"), work / "tiny", dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(work / "tiny")
    prompts = [tokenizer.encode(text)
               for text in held_out_prompts(sum(NUM_PROMPTS["tiny"].values()))]
    (work / "prompts_tiny.json").write_text(json.dumps(prompts))
    print(f"wrote {work}/tiny and {len(prompts)} prompts")


def targets(work: Path) -> dict[str, dict]:
    import random

    config_dir = work / "llama3-8b-shape"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    rng = random.Random(0)
    # 512-token prompts built from a few hundred distinct ids: dummy weights
    # then continue with text in which n-grams recur, as in real long contexts
    prompts_8b = [[rng.randrange(1000, 1400) for _ in range(512)]
                  for _ in range(sum(NUM_PROMPTS["llama3-8b-shape"].values()))]
    return {
        "tiny": dict(model=str(work / "tiny"), prompts=json.loads(
            (work / "prompts_tiny.json").read_text()), max_tokens=128,
            num_prompts=NUM_PROMPTS["tiny"], tie_check=True,
            engine=dict(dtype="float32", max_model_len=1024)),
        "llama3-8b-shape": dict(model=str(config_dir), prompts=prompts_8b, max_tokens=256,
                                num_prompts=NUM_PROMPTS["llama3-8b-shape"], tie_check=False,
                                engine=dict(dtype="bfloat16", load_format="dummy",
                                            skip_tokenizer_init=True, max_model_len=1024)),
    }


def prompts_for(target: dict, batch_size: int) -> list:
    """The prompts of one batch size: disjoint slices, in BATCH_SIZES order."""
    counts, prompts = target["num_prompts"], target["prompts"]
    start = sum(counts[b] for b in BATCH_SIZES[:BATCH_SIZES.index(batch_size)])
    chosen = prompts[start:start + counts[batch_size]]
    if len(chosen) < counts[batch_size]:
        raise ValueError(f"{len(prompts)} prompts are too few: run 'prepare' again")
    return [{"prompt_token_ids": p} for p in chosen]


@contextmanager
def environment(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_method(target: dict, name: str, method: Method) -> list[dict]:
    from vllm_specplug.engine import generate, greedy_params, running_llm
    from vllm_specplug.metrics import read_spec_decode_counts
    from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

    rows = []
    kwargs = dict(enforce_eager=False, gpu_memory_utilization=0.85, max_num_seqs=64,
                  worker_extension_cls=PROBE_QUALNAME, cudagraph_metrics=True,
                  **target["engine"], **method.engine)
    started = time.perf_counter()
    with environment(method.env), running_llm(target["model"], method.spec, **kwargs) as llm:
        startup = time.perf_counter() - started
        state = llm.collective_rpc("specplug_runner_state")[0]
        generate(llm, [{"prompt_token_ids": target["prompts"][0][:4]}], greedy_params(8))  # warm-up
        for batch_size in BATCH_SIZES:
            inputs = prompts_for(target, batch_size)
            llm.collective_rpc("specplug_record_cudagraph_modes")
            before = read_spec_decode_counts(llm)
            stats_before = llm.collective_rpc("specplug_speculator_stats")[0]
            token_ids, seconds = [], 0.0
            for start in range(0, len(inputs), batch_size):
                result = generate(llm, inputs[start:start + batch_size],
                                  greedy_params(target["max_tokens"]))
                token_ids += result.token_ids
                seconds += result.seconds
            counts = read_spec_decode_counts(llm) - before
            graphs = llm.collective_rpc("specplug_cudagraph_modes")[0]
            stats = stats_delta(stats_before, llm.collective_rpc("specplug_speculator_stats")[0])
            rows.append(row_of(name, batch_size, token_ids, seconds, counts, state, startup,
                               graphs, stats))
            if method.spec is None and target["tie_check"]:   # untimed: where ties are
                rows[-1]["gaps"] = tie_gaps(llm, inputs, batch_size, target["max_tokens"])
            print(f"  {name} batch {batch_size}: {rows[-1]['tokens_per_second']:.0f} tok/s, "
                  f"accept len {rows[-1]['acceptance_length']:.2f}", flush=True)
    return rows


def tie_gaps(llm, inputs: list, batch_size: int, max_tokens: int) -> list[list[float]]:
    """Top-2 log-probability gaps of every greedy token (bench/compare.py)."""
    from vllm_specplug.bench.compare import top2_gaps
    from vllm_specplug.engine import greedy_params

    gaps = []
    for start in range(0, len(inputs), batch_size):
        outputs = llm.generate(inputs[start:start + batch_size],
                               greedy_params(max_tokens, logprobs=2), use_tqdm=False)
        gaps += top2_gaps(outputs)
    return gaps


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """Our speculator's counters over one batch size (None: not ours)."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in after}
    steps = max(delta["num_steps"], 1)
    # host work per step, without the wait for the GPU that the host path's
    # copy of the sampled tokens includes (wait_seconds; absent before 11-23)
    busy = delta["host_seconds"] - delta.get("wait_seconds", 0.0)
    return {"host_ms_per_step": 1000 * busy / steps,
            "draft_fill": (delta["num_draft_tokens"] / delta["num_draft_slots"]
                           if delta["num_draft_slots"] else None), **delta}


def full_graph_share(graphs: list[dict], query_len: int) -> float | None:
    """Share of decode-sized steps (a multiple of the query length, more than
    one token) that replayed a FULL CUDA graph."""
    decode = [g for g in graphs if g["num_tokens"] % query_len == 0]
    total = sum(g["count"] for g in decode)
    full = sum(g["count"] for g in decode if "FULL" in str(g["mode"]))
    return full / total if total else None


def row_of(name, batch_size, token_ids, seconds, counts, state, startup, graphs,
           stats) -> dict:
    num_tokens = sum(len(t) for t in token_ids)
    accepted = counts.num_accepted_tokens
    decode_tokens = num_tokens - len(token_ids)   # the first token comes from prefill
    decode_steps = decode_tokens - accepted
    query_len = K + 1 if name != "none" else 1
    return {"method": name, "batch_size": batch_size, "num_requests": len(token_ids),
            "num_tokens": num_tokens, "seconds": seconds,
            "tokens_per_second": num_tokens / seconds,
            "acceptance_length": 1 + accepted / counts.num_drafts if counts.num_drafts else 1.0,
            "tokens_per_step": decode_tokens / decode_steps if decode_steps else 1.0,
            "num_drafts": counts.num_drafts, "num_draft_tokens": counts.num_draft_tokens,
            "num_accepted_tokens": accepted, "accepted_per_pos": list(counts.accepted_per_pos),
            "runner": state["runner"].rsplit(".", 2)[-2] if state["runner"] else None,
            "speculator": state["speculator"], "async_scheduling": state["async_scheduling"],
            "scheduler": (state.get("scheduler_cls") or "default").rsplit(".", 1)[-1],
            "full_graph_share": full_graph_share(graphs, query_len), "cudagraph_modes": graphs,
            "capture_sizes": state["cudagraph_capture_sizes"], "speculator_stats": stats,
            "startup_seconds": startup, "token_ids": token_ids}


def compare(rows: list[dict]) -> None:
    """Ratios to no speculation, and every differing output: a flipped
    floating-point tie (the baseline's top-2 gap there < NEAR_TIE_GAP) or a
    real difference."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences

    base = {r["batch_size"]: r for r in rows if r["method"] == "none"}
    for row in rows:
        ref = base.get(row["batch_size"])
        row["speedup"] = row["tokens_per_second"] / ref["tokens_per_second"] if ref else None
        row["num_exact"] = (sum(a == b for a, b in zip(ref["token_ids"], row["token_ids"]))
                            if ref else None)
        if ref and "gaps" in ref:
            found = divergences(ref["token_ids"], row["token_ids"], ref["gaps"])
            row["divergences"] = found
            row["num_ties"] = sum(d["gap"] < NEAR_TIE_GAP for d in found)


def table(target: str, rows: list[dict]) -> str:
    lines = [f"## {target}",
             "| method | batch | tok/s | vs none | accept len | tok/step | exact | runner | "
             "speculator | async | FULL graphs | host ms/step | draft fill |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = list(METHODS)
    for r in sorted(rows, key=lambda r: (r["batch_size"], order.index(r["method"]))):
        share, stats = r["full_graph_share"], r.get("speculator_stats") or {}
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {r['tokens_per_second']:.0f} | "
            f"{_fmt(r['speedup'], '{:.2f}x')} | {r['acceptance_length']:.2f} | "
            f"{r['tokens_per_step']:.2f} | {_exact(r)} | "
            f"{r['runner']} | {r['speculator']} | "
            f"{r['scheduler'] if r['async_scheduling'] else 'off'} | {_fmt(share, '{:.0%}')} | "
            f"{_fmt(stats.get('host_ms_per_step'), '{:.2f}')} | "
            f"{_fmt(stats.get('draft_fill'), '{:.0%}')} |")
    return "\n".join(lines)


def _exact(row: dict) -> str:
    """"62/64" and, where outputs differ, how many of them are flipped ties."""
    text = f"{row['num_exact']}/{row['num_requests']}"
    if "num_ties" in row and row["num_exact"] != row["num_requests"]:
        real = row["num_requests"] - row["num_exact"] - row["num_ties"]
        text += f" +{row['num_ties']} tie" + (f", {real} DIFFER" if real else "")
    return text


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def plot(all_rows: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_rows), figsize=(7 * len(all_rows), 4.5), squeeze=False)
    for ax, (target, rows) in zip(axes.flat, all_rows.items()):
        methods = [m for m in METHODS if m != "none" and any(r["method"] == m for r in rows)]
        width = 0.8 / max(len(methods), 1)
        for j, method in enumerate(methods):
            ys = [next((r["speedup"] or 0 for r in rows if r["method"] == method
                        and r["batch_size"] == b), 0) for b in BATCH_SIZES]
            ax.bar([i + j * width for i in range(len(BATCH_SIZES))], ys, width, label=method,
                   color=f"C{list(METHODS).index(method) % 10}")  # one colour per method
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(BATCH_SIZES))],
                      [f"batch {b}" for b in BATCH_SIZES])
        ax.set_title(f"{target}: tokens/s vs no speculation (H100, K={K})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(work: Path, results: Path, target_names: list[str], methods: list[str]) -> None:
    from tqdm import tqdm

    results.mkdir(parents=True, exist_ok=True)
    chosen = {k: v for k, v in targets(work).items() if not target_names or k in target_names}
    jobs = [(t, m) for t in chosen for m in METHODS if not methods or m in methods]
    for target_name, method in tqdm(jobs, desc="engines"):
        try:
            rows = run_method(chosen[target_name], method, METHODS[method])
        except Exception as error:  # one failing engine must not lose the others
            print(f"  {target_name} / {method} FAILED: {error!r}", flush=True)
            continue
        name = f"{target_name}__{method.replace(' ', '_')}.json"
        (results / name).write_text(json.dumps({"target": target_name, "rows": rows}))


def report(results: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    all_rows: dict[str, list[dict]] = {}
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        all_rows.setdefault(data["target"], []).extend(data["rows"])
    texts = []
    for target, rows in all_rows.items():
        compare(rows)
        texts.append(table(target, rows))
    (out / "model_runner_v2.txt").write_text("\n\n".join(texts) + "\n")
    slim = {t: [{k: v for k, v in r.items() if k not in ("token_ids", "gaps")} for r in rows]
            for t, rows in all_rows.items()}
    (out / "model_runner_v2.json").write_text(json.dumps(slim, indent=1))
    plot(all_rows, out / "model_runner_v2.png")
    print("\n\n".join(texts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["prepare", "run", "report"])
    parser.add_argument("--work", type=Path, default=Path(".gpu/work"))
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--targets", nargs="*", default=[], help="tiny llama3-8b-shape")
    parser.add_argument("--methods", nargs="*", default=[], help=", ".join(METHODS))
    args = parser.parse_args()
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {list(METHODS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.step == "prepare":
        prepare(args.work)
    elif args.step == "run":
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        run(args.work, args.results, args.targets, args.methods)
        report(args.results, args.out)
    else:
        report(args.results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
