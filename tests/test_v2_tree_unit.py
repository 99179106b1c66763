"""Unit tests of the Model Runner V2 tree step's pure pieces (no engine: Model
Runner V2 needs CUDA; its engine tests are tests/gpu/test_tree_eagle_cuda.py).

KV compaction's slot pairs move every accepted node to its depth and write
no slot twice with different data; the tree slots keep what was drafted;
the head runtime's padded ingest equals its ragged ingest."""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.integration.v2.tree_sampler import compaction_slots
from vllm_specplug.integration.v2.tree_slots import TreeSlots
from vllm_specplug.verification.tree_greedy import verify_tree_greedy

from tests.kernels.trees import random_tree, target_following_tree


def test_compaction_moves_each_accepted_node_to_its_depth():
    *_, tree = random_tree(5, 3, 4, 10, 40, seed=4)
    _, argmax = target_following_tree(tree, 40, follow=0.9, seed=4)
    verified = verify_tree_greedy(tree, argmax, backend="torch")
    num_nodes = torch.tensor([10, 10, 1, 10, 4])  # a request without drafts, a cut tree
    accepted = verified.accepted_node_ids.clone()
    num_accepted = verified.num_accepted.clone()
    num_accepted[2] = 0
    accepted[2, 1:] = -1
    cut = (accepted[4] >= 4).nonzero()
    if len(cut):  # the cut tree accepts only nodes it had
        first_cut = int(cut[0])
        accepted[4, first_cut:] = -1
        num_accepted[4] = first_cut - 1
    query_start = torch.tensor([0, 10, 20, 21, 31, 35], dtype=torch.int32)
    slot_mapping = torch.randperm(200)[:40].long()  # rows -> cache slots, scattered
    source, destination = compaction_slots(slot_mapping, query_start, accepted, num_accepted,
                                           num_nodes)
    cache = torch.arange(200.0)[:, None].repeat(1, 3)  # slot s holds s
    before = cache.clone()
    cache[destination] = cache[source]  # every read before any write, as the engine does
    for b in range(5):
        first = int(query_start[b])
        for depth in range(int(num_accepted[b]) + 1):
            node = int(accepted[b, depth])
            want = before[slot_mapping[first + node]]
            assert torch.equal(cache[slot_mapping[first + depth]], want), (b, depth)
    written: dict[int, set[int]] = {}
    for s, d in zip(source.tolist(), destination.tolist()):
        written.setdefault(d, set()).add(s)
    assert all(len(sources) == 1 for sources in written.values()), \
        "a slot written from two sources (a race on the GPU)"
    moved = {d for s, d in zip(source.tolist(), destination.tolist()) if s != d}
    untouched = torch.ones(200, dtype=torch.bool)
    untouched[list(moved)] = False
    assert torch.equal(cache[untouched], before[untouched])


def test_tree_slots_store_and_forget():
    *_, tree = random_tree(3, 3, 4, 8, 40, seed=1)
    slots = TreeSlots(6, 8, "cpu")
    index = torch.tensor([4, 0, 2])
    slots.store(index, tree, True)
    assert torch.equal(slots.parents[index], tree.parent_ids)
    assert torch.equal(slots.depths[index], tree.depths.int())
    assert torch.equal(slots.bits[index], tree.packed_mask)
    assert slots.is_tree.tolist() == [1, 0, 1, 0, 1, 0]
    slots.forget(torch.tensor([2]))
    assert slots.is_tree.tolist() == [1, 0, 0, 0, 1, 0]
    assert slots.parents[2].tolist() == list(range(-1, 7))  # verified as a chain
    assert slots.depths[2].tolist() == list(range(8))


def test_padded_ingest_equals_ragged_ingest():
    """What the V2 speculator does for decoding requests (verified rows padded
    by repetition, on the device) leaves the head's cache and last output as
    the ragged ingest does."""
    from vllm_specplug.models.heads import build_head
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    head = load_head(build_head("tiny-eagle3"))
    embed = torch.nn.Embedding(head.config.vocab_size, head.config.hidden_size)
    width = head.config.target_hidden_size * len(head.config.aux_layer_ids)
    generator = torch.Generator().manual_seed(0)
    runtimes = [HeadRuntime(head, embed) for _ in range(2)]
    for runtime in runtimes:
        runtime.make_pool(4, torch.float32, "cpu")
    prefix = torch.randn(12, width, generator=generator)
    prefix_ids = torch.randint(0, 100, (12,), generator=generator)
    for runtime in runtimes:  # both cache positions 0..5 of slots 1 and 3
        runtime.ingest_slots(np.array([1, 3]), np.array([True, True]), prefix, prefix_ids,
                             np.array([0, 1, 2, 3, 4, 5] * 2), [6, 6])
    counts = [3, 1]  # slot 1 verified 3 positions, slot 3 one
    hidden = torch.randn(4, width, generator=generator)
    ids = torch.randint(0, 100, (4,), generator=generator)
    positions = np.array([6, 7, 8, 6])
    runtimes[0].ingest_slots(np.array([1, 3]), np.array([False, False]), hidden, ids,
                             positions, counts)
    take = torch.tensor([0, 1, 2, 2, 3, 3, 3, 3])  # 4 rows each, the last repeated
    runtimes[1].ingest_padded(torch.tensor([1, 3]), hidden[take], ids[take],
                              torch.from_numpy(positions)[take].view(2, 4),
                              torch.tensor([6, 6]), max_position=8)
    ragged, padded = (r.pool for r in runtimes)
    for name in ("keys", "values", "last_out", "last_logits"):
        torch.testing.assert_close(getattr(padded, name), getattr(ragged, name),
                                   atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.valid, ragged.valid)
