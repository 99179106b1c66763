"""The graft kernel (kernels/lookup_graft.py) against its PyTorch reference
(`graft_lookups`, the host path of `DeviceLookup.graft`): the stored trees
of scattered state slots, their drafts, depths, packed masks over two words
and ranks, and the counters, on histories with a whole lookup, a partial
one (fewer than K tokens after the match) and none."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_lookup_unit import random_trees
from vllm_specplug.proposers.lookup import DeviceLookup
from vllm_specplug.verification.tree_build import _ancestry, pack_mask

VOCAB = 3  # small: histories repeat and trees hold lookup prefixes by chance


def stored_trees(rng, num_slots: int, width: int):
    """TreeSlots' stored fields for `num_slots` random trees of `width` nodes."""
    tokens, parents = random_trees(rng, num_slots, width, VOCAB)
    parent_t = torch.from_numpy(parents)
    depths, mask = _ancestry(parent_t)
    ranks = torch.from_numpy(rng.permutation(width)).repeat(num_slots, 1) - 1
    return tokens, SimpleNamespace(parents=parent_t, depths=depths.to(torch.int32),
                                   bits=pack_mask(mask), ranks=ranks)


@pytest.mark.parametrize("width,num_nodes,k,keep_ranks", [(40, 37, 5, True),
                                                          (16, 16, 4, False),
                                                          (6, 4, 4, True)])
def test_the_kernel_grafts_what_the_reference_grafts(device, width, num_nodes, k, keep_ranks):
    rng = np.random.default_rng(width + k)
    num_reqs, num_slots, max_len = 12, 15, 90
    histories = [rng.integers(0, VOCAB, size=n).astype(np.int32)
                 for n in rng.integers(2, max_len, size=num_reqs)]
    # "1 2" recurs only just before the end: a partial lookup, 2 tokens
    histories[0] = np.array([0] * 7 + [1, 2, 1, 2], dtype=np.int32)
    token_ids = torch.zeros(num_slots, max_len, dtype=torch.int32)
    num_tokens = torch.zeros(num_slots, dtype=torch.int32)
    slots = torch.from_numpy(rng.permutation(num_slots)[:num_reqs])
    for slot, history in zip(slots.tolist(), histories):
        token_ids[slot, :len(history)] = torch.from_numpy(history)
        num_tokens[slot] = len(history)
    num_sampled = torch.from_numpy(rng.integers(0, 2, size=num_reqs).astype(np.int32) + 1)
    num_sampled[3] = 0  # a prefill chunk: no lookup
    tokens, trees = stored_trees(rng, num_slots, width)
    drafts = torch.from_numpy(tokens[slots.numpy(), 1:]).contiguous()
    drafts = torch.cat([drafts, torch.full((num_reqs, 2), -9)], 1)  # wider, as V2's
    if not keep_ranks:
        trees.ranks = None
    results = []
    for kernels in (True, False):
        lookup = DeviceLookup(2, 4, num_slots, max_len, k, torch.device(device),
                              kernels=kernels)
        on = SimpleNamespace(**{name: None if value is None else value.clone().to(device)
                                for name, value in vars(trees).items()})
        mine = drafts.clone().to(device)
        lookup.graft([f"r{i}" for i in range(num_reqs)], token_ids.to(device),
                     slots.to(device), num_tokens.to(device), num_sampled.to(device), mine,
                     on, num_nodes)
        results.append(({name: None if value is None else value.cpu().tolist()
                         for name, value in vars(on).items()}, mine.cpu().tolist(),
                        lookup.stats()))
        if kernels:
            found = lookup.num_draft[:num_reqs].cpu()
    # partial lookups (fewer than k tokens after the match: a tree takes them) among them
    assert ((found > 0) & (found < k)).any() and (found == k).any()
    assert results[0] == results[1]
    stats = results[0][2]
    assert 0 < stats["lookup_rows"] < num_reqs  # rows of both kinds
    # some lookups were partly in their tree already
    assert 0 < stats["lookup_nodes"] < stats["lookup_rows"] * min(k, num_nodes - 1)
    assert results[0][0] != {name: None if value is None else value.tolist()
                             for name, value in vars(trees).items()}  # trees did change


def test_the_warm_up_launches_every_kernel_and_writes_nothing(device):
    """`DeviceLookup.warm_up` (the speculator's capture): a chain's and each
    tree size's launches on the step's own buffers leave them as they were."""
    rng = np.random.default_rng(5)
    num_slots, max_len, k = 6, 40, 4
    token_ids = torch.from_numpy(rng.integers(0, VOCAB, size=(num_slots, max_len))
                                 .astype(np.int32)).to(device)
    num_tokens = torch.full((num_slots,), max_len, dtype=torch.int32, device=device)
    _, trees = stored_trees(rng, num_slots, 16)
    trees = SimpleNamespace(**{n: v.to(device) for n, v in vars(trees).items()})
    before = {n: v.clone() for n, v in vars(trees).items()}
    drafts = torch.from_numpy(rng.integers(0, VOCAB, size=(num_slots, 15))).to(device)
    kept = drafts.clone()
    lookup = DeviceLookup(2, 4, num_slots, max_len, k, torch.device(device), kernels=True)
    assert lookup.warm_up(token_ids, num_tokens, drafts, trees, (5, 16)) == 6
    assert lookup.warm_up(token_ids, num_tokens, drafts[:, :k], None, ()) == 2  # a chain's
    assert drafts.equal(kept)
    assert all(getattr(trees, n).equal(v) for n, v in before.items())
    assert lookup.stats() == {"lookup_rows": 0, "lookup_nodes": 0}
    off = DeviceLookup(2, 4, num_slots, max_len, k, torch.device(device), kernels=False)
    assert off.warm_up(token_ids, num_tokens, drafts, trees, (16,)) == 0
