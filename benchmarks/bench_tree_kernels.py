"""Tree-speculation kernels vs their PyTorch references on a GPU.

    python benchmarks/bench_tree_kernels.py --out results.json

Kernels are timed through their wrappers with `validate=False` (input checks
sync with the host and are not part of the kernel). Prints median microseconds per call: `kernel us` from CUDA-graph replays
(do_bench_cudagraph; vLLM runs decode under cudagraphs), `eager us` from plain
launches (do_bench), GB/s of the
bytes each kernel must move, the fraction of measured HBM bandwidth, and, for
batch 64 / 16 nodes / vocab 128256, the cost relative to one Llama-3-8B decode
step's weight reads (16 GB at the measured bandwidth).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from vllm_specplug.verification.kv_compaction import compact_kv_cache
from vllm_specplug.verification.synthetic import random_candidates
from vllm_specplug.verification.tree_build import build_draft_tree
from vllm_specplug.verification.tree_greedy import verify_tree_greedy
from vllm_specplug.verification.tree_sampling import (rejection_sample_chain,
                                                      verify_tree_stochastic)

TREE_SHAPES = {8: (4, 3), 16: (4, 5), 64: (8, 4)}  # nodes -> (topk, depth)
LLAMA3_8B_WEIGHT_BYTES = 16e9
MAX_PROBS_ELEMENTS = 2**31  # skip target_probs tensors above 8 GB


def median_us(fn, reps=50) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=reps, return_mode="median") * 1e3


def measure_bandwidth() -> float:
    src = torch.empty(2**30 // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), reps=200)
    return 2 * src.numel() * 4 / (us * 1e-6) / 1e9  # read + write


def make_tree(batch, num_nodes, seed=0):
    topk, depth = TREE_SHAPES[num_nodes]
    cands = random_candidates(batch, topk, depth, 1000, seed, device="cuda")
    roots = torch.randint(0, 1000, (batch,), device="cuda")
    seq_lens = torch.randint(100, 2000, (batch,), device="cuda")
    return cands, roots, seq_lens


def following_probs(tree, vocab_size):
    """Target probs that favour each node's first child (walks go deep)."""
    batch, n = tree.token_ids.shape
    logits = torch.randn(batch, n, vocab_size, device="cuda")
    first = tree.first_child_ids
    child_tok = tree.token_ids.gather(1, first.clamp(min=0))
    bonus = torch.where(first >= 0, 8.0, 0.0)
    logits.scatter_add_(2, child_tok[..., None], bonus[..., None])
    return logits.softmax(-1)


def bench_tree(batch, num_nodes, vocab_size, rows):
    cands, roots, seq_lens = make_tree(batch, num_nodes)
    build = lambda b: build_draft_tree(cands, roots, seq_lens, num_nodes, backend=b,
                                       validate=False)
    tree = build("triton")
    rows.append(row("tree_build", batch, num_nodes, None, build, 0))
    probs_ok = batch * num_nodes * vocab_size <= MAX_PROBS_ELEMENTS
    if not probs_ok:
        return
    probs = following_probs(tree, vocab_size)
    argmax = probs.argmax(-1)
    rows.append(row("verify_greedy", batch, num_nodes, vocab_size,
                    lambda b: verify_tree_greedy(tree, argmax, backend=b, validate=False), 0))
    uniform = torch.rand(batch, num_nodes, device="cuda")
    exp = torch.empty(batch, vocab_size, device="cuda").exponential_()
    stochastic = lambda b: verify_tree_stochastic(tree, probs, uniform, exp, backend=b,
                                                  validate=False)
    rows.append(row("verify_stochastic", batch, num_nodes, vocab_size, stochastic,
                    batch * vocab_size * 8))  # one target row + one noise row
    return tree, argmax


def bench_compaction(batch, num_nodes, tree, argmax, rows):
    layers, heads, head_size, block_size = 32, 8, 128, 16
    verified = verify_tree_greedy(tree, argmax, backend="triton")
    seq_lens = tree.positions[:, 0]
    blocks = (int(seq_lens.max()) + num_nodes) // block_size + 1
    cache = torch.randn(layers, 2, batch * blocks, block_size, heads, head_size,
                        dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).int()
    nodes = verified.accepted_node_ids
    moved = int(((nodes != torch.arange(num_nodes, device="cuda")) & (nodes >= 0)).sum())
    fn = lambda b: compact_kv_cache(cache, table, seq_lens, nodes, verified.num_accepted,
                                    backend=b, validate=False)
    rows.append(row("kv_compaction_32L", batch, num_nodes, None, fn,
                    moved * 2 * layers * 2 * heads * head_size * 2))


def bench_chain(batch, vocab_size, rows, num_drafts=4):
    draft = torch.rand(batch, num_drafts, vocab_size, device="cuda").softmax(-1)
    target = torch.rand(batch, num_drafts + 1, vocab_size, device="cuda").softmax(-1)
    ids = torch.randint(0, vocab_size, (batch, num_drafts), device="cuda")
    counts = torch.full((batch,), num_drafts, device="cuda")
    uniform = torch.rand(batch, num_drafts, device="cuda")
    exp = torch.empty(batch, vocab_size, device="cuda").exponential_()
    fn = lambda b: rejection_sample_chain(ids, counts, draft, target, uniform, exp,
                                         backend=b, validate=False)
    rows.append(row("chain_rejection", batch, num_drafts + 1, vocab_size, fn,
                    batch * vocab_size * 12))  # target + draft + noise rows


def graph_us(fn) -> float:
    """Median of CUDA-graph replays: the launch cost vLLM pays under cudagraphs."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def row(name, batch, num_nodes, vocab_size, fn, bytes_moved):
    kernel_us = graph_us(lambda: fn("triton"))
    eager_us = median_us(lambda: fn("triton"))
    reference_us = median_us(lambda: fn("torch"), reps=20 if batch <= 64 else 5)
    return dict(kernel=name, batch=batch, nodes=num_nodes, vocab=vocab_size,
                kernel_us=kernel_us, eager_us=eager_us, reference_us=reference_us,
                gb_per_s=bytes_moved / (kernel_us * 1e-6) / 1e9 if bytes_moved else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--batches", default="1,8,64,256")
    args = parser.parse_args()
    bandwidth = measure_bandwidth()
    rows: list[dict] = []
    for batch in map(int, args.batches.split(",")):
        for num_nodes in TREE_SHAPES:
            for vocab_size in (32000, 128256):
                made = bench_tree(batch, num_nodes, vocab_size, rows)
                if made and vocab_size == 128256:
                    bench_compaction(batch, num_nodes, *made, rows)
        for vocab_size in (32000, 128256):
            bench_chain(batch, vocab_size, rows)
    print_table(rows, bandwidth)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                           torch=torch.__version__, triton=triton.__version__,
                           hbm_gb_per_s=bandwidth, rows=rows), handle, indent=1)


def print_table(rows, bandwidth) -> None:
    step_us = LLAMA3_8B_WEIGHT_BYTES / (bandwidth * 1e9) * 1e6
    print(f"{torch.cuda.get_device_name()}: measured copy bandwidth {bandwidth:.0f} GB/s; "
          f"Llama-3-8B decode step (16 GB) = {step_us:.0f} us")
    print(f"{'kernel':<20}{'batch':>6}{'nodes':>6}{'vocab':>8}{'kernel us':>11}"
          f"{'eager us':>10}{'ref us':>10}{'speedup':>9}{'GB/s':>8}{'%HBM':>6}{'%8B step':>9}")
    for r in rows:
        gbs = r["gb_per_s"]
        print(f"{r['kernel']:<20}{r['batch']:>6}{r['nodes']:>6}{str(r['vocab'] or '-'):>8}"
              f"{r['kernel_us']:>11.1f}{r['eager_us']:>10.1f}{r['reference_us']:>10.1f}"
              f"{r['reference_us'] / r['kernel_us']:>9.1f}"
              f"{(f'{gbs:.0f}' if gbs else '-'):>8}"
              f"{(f'{100 * gbs / bandwidth:.0f}' if gbs else '-'):>6}"
              f"{100 * r['kernel_us'] / step_us:>9.2f}")


if __name__ == "__main__":
    main()
