"""KV compaction: kernel == reference, only the intended slots change, and the
moved rows are the accepted nodes' rows."""
from __future__ import annotations

import pytest
import torch

from vllm_specplug.verification.checks import VerificationInputError
from vllm_specplug.verification.kv_compaction import (compact_kv_cache, compact_kv_layers,
                                                      kv_layers)
from vllm_specplug.verification.tree_greedy import verify_tree_greedy

from tests.kernels.conftest import LARGE_BATCH
from tests.kernels.trees import random_tree, target_following_tree

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def paged_setup(batch, num_nodes, block_size, heads, head_size, dtype, seed, device,
                layers=2):
    """A tree verified greedily, and a shuffled paged cache holding its nodes."""
    *_, tree = random_tree(batch, 4, 4, num_nodes, 111, seed=seed, device=device)
    _, argmax = target_following_tree(tree, 111, follow=0.9, seed=seed)
    verified = verify_tree_greedy(tree, argmax, backend="torch")
    seq_lens = tree.positions[:, 0]
    blocks_per_req = (int(seq_lens.max()) + num_nodes) // block_size + 1
    num_blocks = batch * blocks_per_req + 3
    generator = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(num_blocks, generator=generator)[:batch * blocks_per_req]
    block_table = block_table.view(batch, blocks_per_req).to(torch.int32)
    cache = torch.randn(layers, 2, num_blocks, block_size, heads, head_size,
                        generator=generator).to(dtype)
    return (cache.to(device), block_table.to(device), seq_lens,
            verified.accepted_node_ids, verified.num_accepted)


def slot(block_table, b, position, block_size):
    return int(block_table[b, position // block_size]) * block_size + position % block_size


@pytest.mark.parametrize("batch", [1, 7, LARGE_BATCH])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_nodes", [(16, 16), (4, 7), (1, 6)])
def test_kernel_equals_reference(batch, dtype, block_size, num_nodes, device):
    cache, *meta = paged_setup(batch, num_nodes, block_size, 2, 24, dtype, batch, device)
    ours, ref = cache.clone(), cache.clone()
    compact_kv_cache(ours, *meta, backend="triton")
    compact_kv_cache(ref, *meta, backend="torch")
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moves_accepted_rows_and_nothing_else(backend, device):
    block_size = 4
    cache, block_table, seq_lens, nodes, num_accepted = paged_setup(
        7, 16, block_size, 2, 8, torch.float32, 3, device)
    before = cache.clone()
    compact_kv_cache(cache, block_table, seq_lens, nodes, num_accepted, backend=backend)
    flat_before = before.view(2, 2, -1, 16)
    flat_after = cache.view(2, 2, -1, 16)
    expected_changed = set()
    for b in range(7):
        for j in range(1, int(num_accepted[b]) + 1):
            src = slot(block_table, b, int(seq_lens[b]) + int(nodes[b, j]), block_size)
            dst = slot(block_table, b, int(seq_lens[b]) + j, block_size)
            assert torch.equal(flat_after[:, :, dst], flat_before[:, :, src])
            if src != dst:
                expected_changed.add(dst)
    changed = (flat_after != flat_before).flatten(3).any(-1).any(0).any(0)
    assert set(changed.nonzero().flatten().tolist()) == expected_changed
    assert expected_changed, "the test trees accepted nothing off the diagonal"


def test_bad_compaction_input_is_named(device):
    cache, block_table, seq_lens, nodes, num_accepted = paged_setup(
        3, 8, 4, 2, 8, torch.float32, 0, device)
    with pytest.raises(VerificationInputError, match="contiguous"):
        compact_kv_cache(cache.transpose(-1, -2), block_table, seq_lens, nodes, num_accepted)
    with pytest.raises(VerificationInputError, match=r"num_accepted holds 8"):
        compact_kv_cache(cache, block_table, seq_lens, nodes, torch.full_like(num_accepted, 8))
    bad_nodes = nodes.clone()
    bad_nodes[:, 1] = 0
    with pytest.raises(VerificationInputError, match="increase along"):
        compact_kv_cache(cache, block_table, seq_lens, bad_nodes, num_accepted.clamp(min=1))
    with pytest.raises(VerificationInputError, match=r"seq_lens \+ num_nodes - 1 holds"):
        compact_kv_cache(cache, block_table, seq_lens + 1000, nodes, num_accepted)
    bad_table = block_table.clone()
    bad_table[0, 0] = 10_000
    with pytest.raises(VerificationInputError, match=r"block_table holds 10000"):
        compact_kv_cache(cache, bad_table, seq_lens, nodes, num_accepted)


@pytest.mark.parametrize("dtype", DTYPES)
def test_destination_that_is_an_earlier_source(dtype, device):
    """Path 0,2,3,4,6,7,9: move 2 writes position 2, which move 1 reads. A
    kernel that writes before all reads of its group finish corrupts it."""
    batch, block_size, num_nodes = 5, 4, 12
    nodes = torch.tensor([0, 2, 3, 4, 6, 7, 9] + [-1] * 5, device=device).expand(batch, -1)
    num_accepted = torch.full((batch,), 6, device=device)
    seq_lens = torch.tensor([0, 1, 3, 5, 17], device=device)
    blocks = (int(seq_lens.max()) + num_nodes) // block_size + 1
    table = torch.randperm(batch * blocks).view(batch, blocks).to(torch.int32).to(device)
    cache = torch.randn(3, 2, batch * blocks, block_size, 8, 128).to(dtype).to(device)
    ours, ref = cache.clone(), cache.clone()
    compact_kv_cache(ours, table, seq_lens, nodes.contiguous(), num_accepted, backend="triton")
    compact_kv_cache(ref, table, seq_lens, nodes.contiguous(), num_accepted, backend="torch")
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_layers_in_one_launch_equal_each_layer(batch, dtype, device):
    """Separately allocated layers (as vLLM allocates them), one launch:
    equal to compacting each layer with the reference, with the roots read
    from the runner's query_start_loc and seq_lens."""
    cache, block_table, roots, nodes, num_accepted = paged_setup(
        batch, 16, 4, 2, 8, dtype, batch, device, layers=3)
    layers = [cache[i].clone() for i in range(3)]  # three allocations
    expected = [layer.clone() for layer in layers]
    for layer in expected:
        compact_kv_cache(layer, block_table, roots, nodes, num_accepted, backend="torch")
    query_lens = torch.randint(1, 17, (batch,))
    query_start = torch.zeros(batch + 2, dtype=torch.int32)  # longer, as the runner's are
    query_start[1:batch + 1] = query_lens.cumsum(0)
    seq_lens = torch.zeros(batch + 2, dtype=torch.int32)
    seq_lens[:batch] = (roots.cpu() + query_lens).int()
    table = kv_layers(layers)
    assert table is not None and table.plane_offsets.shape == (6,)
    compact_kv_layers(table, block_table, query_start.to(device), seq_lens.to(device),
                      nodes, num_accepted, backend="triton")
    for ours, ref in zip(layers, expected):
        assert torch.equal(ours, ref)
    assert not torch.equal(layers[0], cache[0])  # something moved


def test_layers_of_different_shapes_are_compacted_one_by_one(device):
    a = torch.zeros(2, 5, 4, 2, 8, device=device)
    assert kv_layers([a, torch.zeros(2, 5, 4, 2, 4, device=device)]) is None
    assert kv_layers([a, a.half()]) is None
    assert kv_layers([a, a.transpose(2, 3)]) is None
