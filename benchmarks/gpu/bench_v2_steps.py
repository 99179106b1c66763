"""Step costs on Model Runner V2 (issue 26): what one decode step of each
speculative method costs on a Llama-3-8B-shaped target (dummy bf16 weights,
FlashAttention) with an 8B-shaped EAGLE-3 head of random weights, at batch
1, 16 and 64. Acceptance is near zero with random weights, so a step's time
is its cost alone; real acceptance comes from the tiny model and SmolLM2
(`vllm-specplug bench offline`), and the two give the projected speed-up.

On the staged GPU host (the 8B config and the 1.6 GB random head are
written there, into the work folder, when missing):

    python3 benchmarks/gpu/bench_v2_steps.py run --work .gpu/work --out $OUT

`--tensor-parallel-size 2` shards the target over two GPUs (issue 29): vLLM's
`eagle3` head is then sharded like the target, ours is replicated (each rank
runs it whole), so the draft phase's times compare the two placements.

One engine per method at a time (five 8B engines do not fit one GPU), each
timing `REPEATS` times two generation lengths per batch size: the
difference cancels prefill, and the decode steps come from vLLM's own
counters (drafting steps), so step ms = (t_long - t_short) / (steps_long -
steps_short). Writes v2_steps.json and v2_steps.txt (median and range).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tree_cuda import ENGINE_8B, build_8b, prompts_8b  # noqa: E402

BATCH_SIZES = (1, 16, 64)
LENGTHS = (16, 80)
REPEATS = 3


def methods(head: str) -> dict[str, dict | None]:
    ours = {"method": "specplug_eagle3", "model": head}
    return {"none": None,
            "vllm-eagle3-K5": {"method": "eagle3", "model": head, "num_speculative_tokens": 5},
            "ours-chain-K5": {**ours, "topk": 1, "num_steps": 5},
            "ours-tree16": {**ours, "topk": 4, "num_steps": 4, "num_draft_tokens": 16},
            "ours-tree32": {**ours, "topk": 4, "num_steps": 8, "num_draft_tokens": 32},
            # without draft_compile (on CUDA the default compiles the head's dense
            # steps since the fifty-first session; "-compiled" rows before it)
            "ours-chain-K5-eager": {**ours, "topk": 1, "num_steps": 5, "draft_compile": False},
            "ours-tree16-eager": {**ours, "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
                                  "draft_compile": False},
            "vllm-ngram-K5": {"method": "ngram", "num_speculative_tokens": 5,
                              "prompt_lookup_min": 2, "prompt_lookup_max": 5},
            "ours-ngram-K5": {"method": "specplug_ngram", "num_speculative_tokens": 5,
                              "prompt_lookup_min": 2, "prompt_lookup_max": 5}}


def _timed(llm, prompts, max_tokens: int) -> tuple[float, int]:
    """(seconds, decode steps summed over requests) of one batch."""
    from vllm import SamplingParams

    from vllm_specplug.metrics import read_spec_decode_counts

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = read_spec_decode_counts(llm)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    drafts = (read_spec_decode_counts(llm) - before).num_drafts
    return seconds, drafts or max_tokens * len(prompts)


def step_ms(llm, prompts) -> float:
    short, long_ = (_timed(llm, prompts, n) for n in LENGTHS)
    steps = (long_[1] - short[1]) / len(prompts)
    return 1000.0 * (long_[0] - short[0]) / steps


def phases(llm, prompts) -> dict:
    """Per-phase host/GPU ms and launches of one generation (bench/phases.py)."""
    from vllm import SamplingParams

    from vllm_specplug.bench.phases import probe

    params = SamplingParams(max_tokens=LENGTHS[-1], temperature=0.0, ignore_eos=True)
    return probe(llm, lambda: llm.generate(prompts, params, use_tqdm=False))


def run(work: Path, out: Path, names: list[str] | None, tensor_parallel_size: int = 1) -> None:
    from vllm_specplug.bench.worker_info import WORKER_INFO_QUALNAME
    from vllm_specplug.engine import make_llm, shutdown_llm

    target, head = build_8b(work)
    chosen = {k: v for k, v in methods(str(head)).items()
              if (k in names if names else "ngram" not in k and "eager" not in k)}
    done = out / "v2_steps.json"  # a run split over calls: keep the other methods' rows
    rows = [r for r in (json.loads(done.read_text()) if done.exists() else [])
            if r["method"] not in chosen]
    for name, spec in chosen.items():
        llm = make_llm(target, spec, **ENGINE_8B, enforce_eager=False, max_num_seqs=64,
                       tensor_parallel_size=tensor_parallel_size,
                       worker_extension_cls=WORKER_INFO_QUALNAME)
        try:
            llm.generate(prompts_8b(2), use_tqdm=False)  # warm-up
            for batch in tqdm(BATCH_SIZES, desc=name):
                prompts = prompts_8b(batch)
                times = [step_ms(llm, prompts) for _ in range(REPEATS)]
                rows.append({"method": name, "spec": spec, "batch": batch, "step_ms": times,
                             "tensor_parallel_size": tensor_parallel_size,
                             "phases": phases(llm, prompts)})
        finally:
            shutdown_llm(llm)
        _write(out, rows)


def _write(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "v2_steps.json").write_text(json.dumps(rows, indent=1))
    lines = [f"{'method':16} {'batch':>5} {'step ms (median)':>17} {'range':>15}"]
    for r in rows:
        t = r["step_ms"]
        lines.append(f"{r['method']:16} {r['batch']:5d} {statistics.median(t):17.2f} "
                     f"{min(t):7.2f}-{max(t):<7.2f}")
    lines += ["", _phases_table(rows)]
    (out / "v2_steps.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _phases_table(rows: list[dict]) -> str:
    from types import SimpleNamespace

    from vllm_specplug.bench.report import format_phases_table

    return format_phases_table([SimpleNamespace(name=r["method"], batch_size=r["batch"],
                                                phases=r["phases"]) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["run"])
    parser.add_argument("--work", type=Path, default=Path(".gpu/work"))
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--methods", nargs="*", help="a subset of the method names "
                        "(default: all but the n-gram and eager rows)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs the target is sharded over")
    args = parser.parse_args()
    run(args.work, args.out, args.methods, args.tensor_parallel_size)


if __name__ == "__main__":
    main()
