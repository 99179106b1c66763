"""Unit tests of the Model Runner V2 tree step's pure pieces (no engine: Model
Runner V2 needs CUDA; its engine tests are tests/gpu/test_tree_eagle_cuda.py).

KV compaction moves every accepted node to its depth on vLLM's CUDA cache
layout and nothing else; the tree slots keep what was drafted;
the head runtime's padded ingest equals its ragged ingest."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_specplug.integration.v2.tree_sampler import compact_kv
from vllm_specplug.integration.v2.tree_slots import TreeSlots
from vllm_specplug.verification.tree_greedy import verify_tree_greedy

from tests.kernels.trees import random_tree, target_following_tree


def test_compaction_moves_each_accepted_node_to_its_depth():
    """On vLLM's CUDA cache layout (logical [blocks, kv_heads, block_size,
    2 * head_size], token-major in memory), with Model Runner V2's batch
    fields: each accepted node's K and V land at root + depth, and nothing
    else changes. (A stand-in batch: Model Runner V2 needs CUDA.)"""
    *_, tree = random_tree(5, 3, 4, 10, 40, seed=4)
    _, argmax = target_following_tree(tree, 40, follow=0.9, seed=4)
    verified = verify_tree_greedy(tree, argmax, backend="torch")
    num_query = torch.tensor([10, 10, 1, 10, 4])  # a request without drafts, a cut tree
    accepted, num_accepted = verified.accepted_node_ids.clone(), verified.num_accepted.clone()
    accepted[2, 1:], num_accepted[2] = -1, 0
    cut = (accepted[4] >= 4).nonzero()
    if len(cut):  # the cut tree accepts only nodes it had
        accepted[4, int(cut[0]):] = -1
        num_accepted[4] = int(cut[0]) - 1
    roots = torch.tensor([3, 17, 8, 0, 25])
    block_size, heads, head_size = 4, 2, 3
    block_table = torch.randperm(60)[:5 * 10].view(5, 10).int()
    physical = torch.randn(60, block_size, heads, 2 * head_size)
    logical = physical.transpose(1, 2)  # what vLLM hands the backends
    before = physical.clone()
    slots = TreeSlots(8, 10, "cpu")
    slots.bind_kv_caches([logical])
    slots.block_table = block_table
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), num_query.cumsum(0)]).int()
    batch = SimpleNamespace(num_reqs=5, query_start_loc=query_start,
                            seq_lens=(roots + num_query).int())
    compact_kv(slots, batch, accepted, num_accepted)

    def row(tensor, b, position):
        block = int(block_table[b, position // block_size])
        return tensor[block, position % block_size]

    moved = set()
    for b in range(5):
        for depth in range(int(num_accepted[b]) + 1):
            node = int(accepted[b, depth])
            assert torch.equal(row(physical, b, int(roots[b]) + depth),
                               row(before, b, int(roots[b]) + node)), (b, depth)
            moved.add((int(block_table[b, (int(roots[b]) + depth) // block_size]),
                       (int(roots[b]) + depth) % block_size))
    for block in range(60):
        for offset in range(block_size):
            if (block, offset) not in moved:
                assert torch.equal(physical[block, offset], before[block, offset])


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
