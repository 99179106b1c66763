"""The CUDA backends' tree-attention glue, driven on CPU (Triton interpreter):
persistent buffers from a step's layout, the call after a backend's forward on
vLLM's logical cache layout, and KV compaction in that layout."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.integration import cuda_tree_attention as cta
from vllm_specplug.integration.cuda_tree_attention import TreeAttentionUnsupported
from vllm_specplug.integration.v1 import cuda_tree_buffers as ctb
from vllm_specplug.integration.v1.tree_step import TreeRequest, TreeStep, depths_of
from vllm_specplug.verification.tree_attention import (metadata_from_masks,
                                                       tree_attention_reference)

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 40
PARENTS = {  # row: parents (root first); row 1 is a chain, row 2 has no drafts
    0: np.array([-1, 0, 0, 1, 2, 1]),
    1: np.array([-1, 0, 1, 2]),
    3: np.array([-1, 0, 0, 0, 3]),
}


def step_of(rows: dict, seq_lens: list[int]) -> TreeStep:
    """A decode step: requests in batch order, drafts as scheduled tokens."""
    sizes = [len(rows.get(r, [0])) for r in range(len(seq_lens))]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    step = TreeStep(int(starts[-1]), starts, np.array(seq_lens, dtype=np.int32))
    for row, parents in rows.items():
        step.requests.append(TreeRequest(row, f"r{row}", int(starts[row]), seq_lens[row],
                                         parents, depths_of(parents)))
    return step


def impl(**overrides):
    attrs = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, scale=0.3,
                 sliding_window=(-1, -1), logits_soft_cap=0, alibi_slopes=None, sinks=None,
                 kv_cache_dtype="auto")
    return SimpleNamespace(**{**attrs, **overrides})


def setup(step: TreeStep, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE,
                           generator=generator)
    block_table = torch.randperm(NUM_BLOCKS, generator=generator)[:32].view(4, 8).int()
    query = torch.randn(step.num_tokens + 3, HEADS * HEAD_SIZE, generator=generator)
    return kv_cache.to(device), block_table.to(device), query.to(device)


def test_buffers_then_backend_hook_equal_the_reference(device):
    step = step_of(PARENTS, [9, 3, 5, 12])
    buffers = ctb.TreeAttentionBuffers(8, 6, device)
    buffers.update(step)
    assert buffers.num_masked == 2  # the chain is left to the backend
    kv_cache, block_table, query = setup(step, device)
    output = torch.full_like(query, 5.0)
    cta.after_backend_forward(impl(specplug_tree_rows=buffers), query, kv_cache,
                              SimpleNamespace(block_table=block_table), output)
    first, counts = [0] * 4, [0] * 4
    dense = torch.zeros(4, 6, 6, dtype=torch.bool)
    for r in step.masked():
        first[r.row], counts[r.row] = r.first_token, r.num_nodes
        dense[r.row, :r.num_nodes, :r.num_nodes] = r.ancestor_mask()
    meta = metadata_from_masks(first, [9, 3, 5, 12], dense.to(device), counts)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    want = torch.full_like(query, 5.0).view(-1, HEADS, HEAD_SIZE)
    tree_attention_reference(query.view(-1, HEADS, HEAD_SIZE), key_cache, value_cache,
                             block_table, meta, 0.3, want)
    torch.testing.assert_close(output.view_as(want), want, atol=2e-5, rtol=2e-5)
    chain_rows = slice(step.requests[1].first_token, step.requests[1].first_token + 4)
    assert torch.equal(output[chain_rows], torch.full_like(output[chain_rows], 5.0))


def test_steps_of_one_token_queries_are_left_to_the_backend(device):
    """A step where no request has more than one query token has no tree
    node (draft length 0 under the batch policy): the backend's output
    stands, as without speculation, whatever rows the buffers still mark;
    a step of longer queries gets its tree rows."""
    step = step_of(PARENTS, [9, 3, 5, 12])
    buffers = ctb.TreeAttentionBuffers(8, 6, device)
    buffers.update(step)
    kv_cache, block_table, query = setup(step, device)
    hooked = impl(specplug_tree_rows=buffers)
    cta.after_backend_forward(hooked, query, kv_cache, SimpleNamespace(block_table=block_table),
                              torch.empty_like(query))  # the first launch (compiles on CUDA)
    outputs = {}
    for most in (1, 6):
        outputs[most] = torch.full_like(query, 5.0)
        cta.after_backend_forward(hooked, query, kv_cache,
                                  SimpleNamespace(block_table=block_table, max_query_len=most),
                                  outputs[most])
    assert torch.equal(outputs[1], torch.full_like(query, 5.0))
    assert not torch.equal(outputs[6], torch.full_like(query, 5.0))


def test_packed_ancestor_masks_equal_pack_mask():
    """Trees of different sizes packed at once equal `pack_mask` of each."""
    from vllm_specplug.verification.tree_build import pack_mask
    from vllm_specplug.verification.tree_masks import pack_ancestor_mask

    rng = np.random.default_rng(0)
    trees = [np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
             for n in (1, 2, 33, 40, 65)]
    words = pack_ancestor_mask(trees, 65, 3)
    for t, parents in enumerate(trees):
        request = TreeRequest(0, "r", 0, 0, parents, depths_of(parents))
        want = pack_mask(request.ancestor_mask()[None])[0]
        n = len(parents)
        assert torch.equal(torch.from_numpy(words[t, :n, :want.shape[1]]), want)
        assert not words[t, :n, want.shape[1]:].any()


def test_a_later_step_clears_stale_rows():
    buffers = ctb.TreeAttentionBuffers(8, 6, "cpu")
    buffers.update(step_of(PARENTS, [9, 3, 5, 12]))
    buffers.update(step_of({0: PARENTS[0]}, [10]))
    assert buffers.metadata.num_nodes.tolist() == [6, 0, 0, 0, 0, 0, 0, 0]
    buffers.update(step_of({}, [11, 4]))
    assert buffers.num_masked == 0 and not buffers.metadata.num_nodes.any()


def test_unsupported_layer_features_are_named(device):
    step = step_of(PARENTS, [9, 3, 5, 12])
    buffers = ctb.TreeAttentionBuffers(8, 6, device)
    buffers.update(step)
    kv_cache, block_table, query = setup(step, device)
    with pytest.raises(TreeAttentionUnsupported, match="sliding window"):
        cta.after_backend_forward(impl(sliding_window=(127, 0), specplug_tree_rows=buffers),
                                  query, kv_cache, SimpleNamespace(block_table=block_table),
                                  query)


def test_compaction_moves_whole_tokens_in_the_logical_layout(device):
    kv_cache = torch.randn(6, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, device=device)
    before = kv_cache.clone()
    src = torch.tensor([9, 14, 3], device=device)
    dst = torch.tensor([8, 9, 22], device=device)  # 9 is read, then written
    cta.move_cached_tokens(kv_cache, src, dst)
    by_slot, old = kv_cache.transpose(1, 2).flatten(0, 1), before.transpose(1, 2).flatten(0, 1)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(by_slot[d], old[s])
    untouched = torch.ones(len(by_slot), dtype=torch.bool, device=device)
    untouched[dst] = False
    assert torch.equal(by_slot[untouched], old[untouched])


def test_after_vllms_triton_backend_float32_tree_rows_use_its_dot_precision(device,
                                                                          monkeypatch):
    """vLLM's Triton attention (float32 targets) leaves `tl.dot` at Triton's
    default, TF32 on CUDA (TRITON_F32_DEFAULT overrides): the tree rows are
    computed the same way, so that they equal what the backend gives
    without speculation; our own default stays IEEE, and other backends and
    dtypes keep it. The hook's rows equal a direct launch at that precision
    bit for bit, and the reference within TF32's rounding."""
    from vllm_specplug.verification.tree_attention import tree_attention_triton

    class TritonAttentionImpl(SimpleNamespace):  # vLLM's class name, duck-typed
        pass

    backend = TritonAttentionImpl(**vars(impl()))
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)  # a run's own (F32=ieee) aside
    assert cta.backend_dot_precision(backend, torch.float32) == "tf32"
    assert cta.backend_dot_precision(backend, torch.bfloat16) is None
    assert cta.backend_dot_precision(impl(), torch.float32) is None
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert cta.backend_dot_precision(backend, torch.float32) == "ieee"
    monkeypatch.delenv("TRITON_F32_DEFAULT")

    step = step_of(PARENTS, [9, 3, 5, 12])
    buffers = ctb.TreeAttentionBuffers(8, 6, device)
    buffers.update(step)
    kv_cache, block_table, query = setup(step, device, seed=2)
    output = torch.full_like(query, 5.0)
    backend.specplug_tree_rows = buffers
    launches = []  # the precision each launch got (the interpreter ignores it: CPU checks this)
    launch = cta.tree_attention_triton
    monkeypatch.setattr(cta, "tree_attention_triton",
                        lambda *a, **k: launches.append(k["precision"]) or launch(*a, **k))
    for _ in range(2):  # the first call compiles every key-split count; the second runs one
        cta.after_backend_forward(backend, query, kv_cache,
                                  SimpleNamespace(block_table=block_table), output)
    assert launches and set(launches) == {"tf32"}
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    direct = torch.full_like(query, 5.0)
    tree_attention_triton(query.view(-1, HEADS, HEAD_SIZE), key_cache, value_cache, block_table,
                          buffers.metadata, 0.3, direct.view(-1, HEADS, HEAD_SIZE),
                          num_requests=4, precision="tf32")
    assert torch.equal(output, direct)
    ieee = torch.full_like(query, 5.0)
    tree_attention_triton(query.view(-1, HEADS, HEAD_SIZE), key_cache, value_cache, block_table,
                          buffers.metadata, 0.3, ieee.view(-1, HEADS, HEAD_SIZE), num_requests=4)
    torch.testing.assert_close(output, ieee, atol=5e-3, rtol=5e-3)
