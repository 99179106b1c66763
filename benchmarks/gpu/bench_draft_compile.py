"""The head's drafting pass with and without `draft_compile`, on the GPU.

A random EAGLE-3 head of a real head's shape (SmolLM2's `smollm2-eagle3-large`
by default: hidden 576, 9 query and 3 KV heads, draft vocabulary 8192) on
`HeadRuntime` as the engines run it (CUDA graphs, our Triton attention),
its caches filled with `--context` positions for each request. For each
batch size and pass shape (chain K=5, tree 16) it times the graphed
drafting pass replayed (CUDA events over `--iters` passes: the GPU's time
a pass, the host only launching one graph) for the eager and the compiled
steps, and counts the drafts on which both agree (bf16: a last-bit
difference may change a near-tied choice; selection only, lossless).
Needs torch and this package only (no vLLM):

    PYTHONPATH=$PWD python3 benchmarks/gpu/bench_draft_compile.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from vllm_specplug.draft_models.eagle3_model import Eagle3Head, HeadConfig
from vllm_specplug.proposers.draft_layers import cast_parameters
from vllm_specplug.proposers.eagle3_head import HeadRuntime

SHAPES = {"smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152,
                          draft_vocab_size=8192, target_hidden_size=576)}
PASSES = {"chain-K5": (1, 5, 6), "tree16": (4, 4, 16)}  # topk, num_steps, num_draft_tokens


def _head(shape: str, dtype: torch.dtype, device: str) -> Eagle3Head:
    config = HeadConfig(**SHAPES[shape], aux_layer_ids=[2, 15, 27], rms_norm_eps=1e-5,
                        rope_theta=100000.0, max_position_embeddings=8192)
    head = Eagle3Head(config)
    head.reset_parameters(torch.Generator().manual_seed(0))
    return cast_parameters(head.eval(), dtype).to(device)


def _runtime(head, embed, batch: int, context: int, compiled: bool) -> HeadRuntime:
    device = embed.weight.device
    runtime = HeadRuntime(head, embed, 0.25, num_slots=batch,
                          cuda_graphs=device.type == "cuda", compile_steps=compiled)
    generator = torch.Generator(device=device).manual_seed(1)
    width = 3 * head.config.target_hidden_size
    req_ids = [f"r{i}" for i in range(batch)]
    runtime.ingest_many(req_ids, torch.randn(batch * context, width, device=device,
                                             generator=generator, dtype=embed.weight.dtype),
                        torch.randint(0, 49152, (batch * context,), device=device,
                                      generator=generator),
                        torch.arange(context, device=device).repeat(batch), [context] * batch)
    return runtime


def _time_pass(runtime: HeadRuntime, batch: int, context: int, shape, iters: int):
    """(ms a pass, the first pass's drafts [B, N]); on CPU (a check of this
    script) wall time."""
    device = runtime.pool.device
    req_ids = [f"r{i}" for i in range(batch)]
    roots = torch.full((batch,), 7, device=device)
    positions = torch.full((batch,), context, device=device)
    tree = runtime.draft_trees(req_ids, roots, positions, *shape)  # captures (compiles first)
    tokens = tree.token_ids.clone()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iters):
            runtime.draft_trees(req_ids, roots, positions, *shape)
        return 1e3 * (time.perf_counter() - started) / iters, tokens
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        runtime.draft_trees(req_ids, roots, positions, *shape)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda", help="cpu: a check of this script")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    head = _head(args.shape, dtype, args.device)
    embed = torch.nn.Embedding(49152, head.config.hidden_size).to(args.device, dtype)
    rows = []
    for batch in args.batches:
        for name, shape in PASSES.items():
            row = {"batch": batch, "pass": name}
            drafts = {}
            for compiled in (False, True):
                started = time.perf_counter()
                runtime = _runtime(head, embed, batch, args.context, compiled)
                ms, drafts[compiled] = _time_pass(runtime, batch, args.context, shape, args.iters)
                row["compiled_ms" if compiled else "eager_ms"] = round(ms, 4)
                row["compiled_setup_s" if compiled else "eager_setup_s"] = round(
                    time.perf_counter() - started, 1)
            row["same_drafts"] = float((drafts[True] == drafts[False]).float().mean())
            row["speedup"] = round(row["eager_ms"] / row["compiled_ms"], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "draft_compile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
