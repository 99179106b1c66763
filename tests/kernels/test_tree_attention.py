"""Tree attention over a paged cache: kernel == reference, the reference ==
causal attention along each node's root path, untouched rows stay, bad
inputs are named."""
from __future__ import annotations

import pytest
import torch

from vllm_specplug.verification.checks import VerificationInputError
from vllm_specplug.verification.tree_attention import (metadata_from_masks, tree_attention,
                                                       unpack_bits)

from tests.kernels.trees import random_tree

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def paged_case(batch, num_nodes, heads, kv_heads, head_size, block_size, dtype, device,
               seed=0, idle=(), extra_prefix=0):
    """Trees + a shuffled paged cache in vLLM's logical layout [blocks, kv_heads,
    block_size, 2 * head_size], split the way vLLM's CUDA backends split it."""
    *_, tree = random_tree(batch, 3, 4, num_nodes, 97, seed=seed)
    num_nodes = tree.token_ids.shape[1]
    seq_lens = tree.positions[:, 0].clone() + extra_prefix
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = (int(seq_lens.max()) + num_nodes) // block_size + 1
    num_blocks = batch * blocks_per_req + 2
    block_table = torch.randperm(num_blocks, generator=generator)[:batch * blocks_per_req]
    block_table = block_table.view(batch, blocks_per_req).to(torch.int32)
    kv_cache = torch.randn(num_blocks, kv_heads, block_size, 2 * head_size,
                           generator=generator).to(dtype)
    key_cache, value_cache = kv_cache.to(device).transpose(1, 2).split(head_size, dim=-1)
    gaps = torch.randint(0, 3, (batch,), generator=generator)  # tokens of other requests
    first = torch.cumsum(gaps + num_nodes, 0) - num_nodes
    query = torch.randn(int(first[-1]) + num_nodes + 2, heads, head_size,
                        generator=generator).to(dtype).to(device)
    counts = torch.full((batch,), num_nodes)
    counts[list(idle)] = 0
    meta = metadata_from_masks(first, seq_lens, tree.attn_mask.to(device), counts)
    return query, key_cache, value_cache, block_table.to(device), meta, tree


def run(case, backend, scale=0.3):
    query, key_cache, value_cache, block_table, meta, _ = case
    output = torch.full_like(query, 7.0)
    tree_attention(query, key_cache, value_cache, block_table, meta, scale, output,
                   backend=backend)
    return output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,num_nodes,heads,kv_heads,head_size,block_size", [
    (1, 8, 2, 2, 16, 16), (3, 13, 4, 1, 40, 16), (5, 20, 8, 2, 64, 8)])
def test_kernel_equals_reference(device, dtype, batch, num_nodes, heads, kv_heads,
                                 head_size, block_size):
    case = paged_case(batch, num_nodes, heads, kv_heads, head_size, block_size, dtype,
                      device, seed=batch + num_nodes, idle=[1] if batch > 2 else [])
    kernel, reference = run(case, "triton"), run(case, "torch")
    torch.testing.assert_close(kernel.float(), reference.float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_each_node_sees_its_root_path_causally():
    """Independent of the mask format: node i's output equals plain causal
    attention over the sequence prefix + (root .. i) with contiguous keys."""
    case = paged_case(2, 11, 4, 2, 16, 4, torch.float32, "cpu", seed=5)
    query, key_cache, value_cache, block_table, meta, tree = case
    out = run(case, "torch", scale=0.25)
    for b in range(2):
        seq_len, first = int(meta.seq_lens[b]), int(meta.first_token[b])
        slots = torch.arange(seq_len + tree.token_ids.shape[1])
        blocks, offsets = block_table[b, slots // 4].long(), slots % 4
        keys = key_cache[blocks, offsets].repeat_interleave(2, 1)
        values = value_cache[blocks, offsets].repeat_interleave(2, 1)
        for i in range(tree.token_ids.shape[1]):
            path = tree.attn_mask[b, i].nonzero().flatten()
            seen = torch.cat([torch.arange(seq_len), seq_len + path])
            q = query[first + i]
            probs = (torch.einsum("hd,lhd->hl", q, keys[seen]) * 0.25).softmax(-1)
            want = torch.einsum("hl,lhd->hd", probs, values[seen])
            torch.testing.assert_close(out[first + i], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_split_keys_merge_to_the_reference(device, dtype, num_splits):
    """Flash-decoding: the keys split over programs (some splits empty,
    others holding only tree keys), merged by log-sum-exp, equal the
    reference; rows outside the trees stay untouched."""
    from vllm_specplug.verification.tree_attention import tree_attention_triton

    case = paged_case(3, 13, 8, 2, 32, 16, dtype, device, seed=num_splits, idle=[1],
                      extra_prefix=150)
    query, key_cache, value_cache, block_table, meta, _ = case
    ours = torch.full_like(query, 7.0)
    tree_attention_triton(query, key_cache, value_cache, block_table, meta, 0.3, ours,
                          block_n=16, num_splits=num_splits)
    reference = run(case, "torch")
    torch.testing.assert_close(ours.float(), reference.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    idle = slice(int(meta.first_token[1]), int(meta.first_token[1]) + 13)
    assert (ours[idle] == 7.0).all()


def test_key_splits_only_where_the_grid_is_small():
    from vllm_specplug.verification.tree_attention import num_key_splits

    assert num_key_splits(8, torch.device("cpu")) == 1  # no SMs to fill off the GPU
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert num_key_splits(8, cuda) == 16 and num_key_splits(128, cuda) == 1


def test_rows_outside_trees_are_untouched(device):
    case = paged_case(4, 9, 2, 1, 16, 16, torch.float32, device, seed=3, idle=[0, 2])
    meta = case[4]
    out = run(case, "triton")
    tree_rows = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    for b in (1, 3):
        start = int(meta.first_token[b])
        tree_rows[start:start + int(meta.num_nodes[b])] = True
    assert torch.equal(out[~tree_rows], torch.full_like(out[~tree_rows], 7.0))
    assert not torch.isclose(out[tree_rows], torch.tensor(7.0, device=out.device)).any()


def test_packed_bits_round_trip():
    *_, tree = random_tree(3, 4, 5, 40, 50, seed=2)
    meta = metadata_from_masks([0, 40, 80], [1, 2, 3], tree.attn_mask, [40, 40, 40])
    assert torch.equal(unpack_bits(meta.ancestor_bits, 40), tree.attn_mask)


@pytest.mark.parametrize("field,value,message", [
    ("num_nodes", 99, "meta.num_nodes"),
    ("first_token", 10_000, "first_token"),
    ("block_table", 10_000, "block_table"),
])
def test_bad_inputs_are_named(field, value, message):
    query, key_cache, value_cache, block_table, meta, _ = paged_case(
        2, 6, 2, 2, 16, 4, torch.float32, "cpu")
    if field == "block_table":
        block_table = block_table.clone()
        block_table[1, 0] = value
    else:
        getattr(meta, field)[1] = value
    with pytest.raises(VerificationInputError, match=message):
        tree_attention(query, key_cache, value_cache, block_table, meta, 1.0,
                       torch.empty_like(query))
