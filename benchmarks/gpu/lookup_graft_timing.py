"""Time a tree step's prompt lookups on the GPU: `DeviceLookup.graft` with
its graft kernel (kernels/lookup_graft.py; 3 launches with the n-gram scan
and finalize) against the same lookups grafted by the PyTorch reference
(`graft_lookups`, about 60 launches), per call, host wall time with the GPU
synchronised, at batch 1 / 16 / 64 and trees of 16 and 64 nodes.

    PYTHONPATH=$HOME/vsite python3 benchmarks/gpu/lookup_graft_timing.py
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from vllm_specplug.proposers.lookup import DeviceLookup, graft_lookups
from vllm_specplug.verification.tree_build import _ancestry, pack_mask


def trees_of(rng, num_slots: int, width: int, device):
    parents = np.zeros((num_slots, width), dtype=np.int64)
    parents[:, 0] = -1
    for i in range(1, width):
        parents[:, i] = rng.integers(max(0, i - 3), i, size=num_slots)
    parent_t = torch.from_numpy(parents)
    depths, mask = _ancestry(parent_t)
    return SimpleNamespace(parents=parent_t.to(device), depths=depths.int().to(device),
                           bits=pack_mask(mask).to(device), ranks=None)


def timed(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    max_len, k = 2048, 4
    print("batch nodes  kernel ms  torch ms")
    for batch in (1, 16, 64):
        token_ids = torch.from_numpy(rng.integers(0, 3, size=(batch, max_len))
                                     .astype(np.int32)).to(device)
        num_tokens = torch.full((batch,), 600, dtype=torch.int32, device=device)
        slots = torch.arange(batch, device=device)
        sampled = torch.ones(batch, dtype=torch.int32, device=device)
        for width in (16, 64):
            trees = trees_of(rng, batch, width, device)
            drafts = torch.from_numpy(rng.integers(0, 3, size=(batch, width - 1))).to(device)
            lookup = DeviceLookup(3, 5, batch, max_len, k, device)
            ids = [f"r{i}" for i in range(batch)]
            kernel = timed(lambda: lookup.graft(ids, token_ids, slots, num_tokens, sampled,
                                                drafts, trees, width))

            def reference():
                looked_up, found = lookup.find(ids, token_ids, slots, num_tokens, sampled,
                                               batch)
                nodes = torch.nn.functional.pad(drafts, (1, 0))
                parents, depths = trees.parents[slots], trees.depths[slots]
                bits = trees.bits[slots]
                graft_lookups(nodes, parents, looked_up, found, depths=depths, bits=bits)
                drafts.copy_(nodes[:, 1:])
                trees.parents.index_copy_(0, slots, parents)
                trees.depths.index_copy_(0, slots, depths)
                trees.bits.index_copy_(0, slots, bits)
            print(f"{batch:5d} {width:5d}  {kernel:9.3f}  {timed(reference):8.3f}")


if __name__ == "__main__":
    main()
