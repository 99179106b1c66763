"""Launch-parameter sweep of the stochastic tree-verification kernel (GPU).

    python benchmarks/sweep_stochastic.py [--out sweep.json]

For batch 8/64/256, 16-node trees, vocab 128256: CUDA-graph median microseconds
and % of measured HBM bandwidth for vocabulary splits x BLOCK_V x num_warps,
against the defaults `sampling_triton` ships with. Used to pick those defaults.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.bench_tree_kernels import (following_probs, graph_us,
                                           make_tree, measure_bandwidth)
from vllm_specplug.verification import sampling_triton
from vllm_specplug.verification.tree_build import build_draft_tree
from vllm_specplug.verification.tree_sampling import verify_tree_stochastic

VOCAB, NODES = 128256, 16


def setup(batch):
    cands, roots, seq_lens = make_tree(batch, NODES)
    tree = build_draft_tree(cands, roots, seq_lens, NODES, backend="triton")
    probs = following_probs(tree, VOCAB)
    uniform = torch.rand(batch, NODES, device="cuda")
    exp = torch.empty(batch, VOCAB, device="cuda").exponential_()
    return tree, probs, uniform, exp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = measure_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for batch in (8, 64, 256):
        tree, probs, uniform, exp = setup(batch)
        expected = verify_tree_stochastic(tree, probs, uniform, exp, backend="torch")
        auto = sampling_triton.choose_splits(batch, VOCAB, probs.device, None)
        splits = sorted({auto, *(max(1, m * sms // batch) for m in (1, 2, 4, 8, 16))})
        for num_splits, block_v, warps in itertools.product(splits, (1024, 2048, 4096),
                                                            (4, 8)):
            sampling_triton.BLOCK_V, sampling_triton.NUM_WARPS = block_v, warps
            fn = lambda: verify_tree_stochastic(tree, probs, uniform, exp,
                                                backend="triton", validate=False,
                                                num_splits=num_splits)
            out = fn()
            assert torch.equal(out.output_token_ids, expected.output_token_ids)
            us = graph_us(fn)
            gbs = batch * VOCAB * 8 / (us * 1e-6) / 1e9
            results.append(dict(batch=batch, splits=num_splits, block_v=block_v,
                                warps=warps, us=us, hbm=gbs / bandwidth,
                                default=(num_splits == auto and block_v == 2048
                                         and warps == 8)))
            print(f"b{batch:<4} splits {num_splits:<5} BLOCK_V {block_v:<5} warps {warps} "
                  f"{us:8.1f} us {100 * gbs / bandwidth:5.1f}% HBM"
                  f"{'  <- current default' if results[-1]['default'] else ''}", flush=True)
    if args.out:
        json.dump({"bandwidth_gb_s": bandwidth, "rows": results}, open(args.out, "w"))


if __name__ == "__main__":
    main()
