"""The draft head's attention read in place from its cache pool: the kernel
equals the float32 reference (gaps in the cache, padding rows, GQA groups,
several key blocks and row tiles, a draft node's path keys), the runtime's
own einsum paths equal the same reference, and a head runtime on the kernel
caches and drafts what it does on the einsums."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_specplug.proposers.head_attention import (attend_cached, attend_draft, draft_context,
                                                    slot_attention, slot_attention_reference)


def _pool(num_slots, num_kv_heads, capacity, head_size, dtype, device, seed=0):
    """A pool's tensors ([S, kvh, C, hd] keys and values, [S, C] validity
    with gaps: a cache that starts past 0 or holds dropped rows)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_slots, num_kv_heads, capacity, head_size)
    return SimpleNamespace(
        keys=torch.randn(*shape, generator=generator).to(dtype).to(device),
        values=torch.randn(*shape, generator=generator).to(dtype).to(device),
        valid=(torch.rand(num_slots, capacity, generator=generator) > 0.2).to(device))


CASES = [  # (kv heads, group, head size, rows per request, path keys)
    (2, 1, 16, 1, 0), (2, 4, 32, 6, 0), (1, 3, 24, 40, 0), (2, 4, 32, 1, 3),
    (2, 2, 16, 4, 5)]


@pytest.mark.parametrize("num_kv_heads,group,head_size,num_rows,num_path", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference(device, num_kv_heads, group, head_size, num_rows,
                                     num_path, dtype):
    pool = _pool(5, num_kv_heads, 200, head_size, dtype, device, seed=num_rows + num_path)
    generator = torch.Generator().manual_seed(7)
    slots = torch.tensor([4, 0, 2], device=device)
    # request 0 mid-cache, 1 past the bucket (cut at num_keys), 2 from 0; -1: padding rows
    starts = torch.tensor([60, 180, 0])
    positions = starts[:, None] + torch.arange(num_rows)
    positions[0, num_rows // 2 + 1:] = -1
    positions = positions.to(device)
    queries = torch.randn(3, num_rows, num_kv_heads * group, head_size,
                          generator=generator).to(dtype).to(device)
    path_kv = None
    if num_path:
        path_kv = tuple(torch.randn(3, num_rows, num_kv_heads, num_path, head_size,
                                    generator=generator).to(dtype).to(device) for _ in "kv")
    for num_keys in (150, 200):
        got = slot_attention(queries, pool, slots, positions, num_keys, 0.3, path_kv,
                             backend="triton")
        want = slot_attention_reference(queries, pool, slots, positions, num_keys, 0.3, path_kv)
        assert got.shape == want.shape and got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
        assert got[0, num_rows // 2 + 1:].eq(0).all()  # padding rows: 0


def test_the_runtimes_einsum_paths_equal_the_reference(device):
    """Off CUDA the runtime keeps its einsums over copied keys: an ingest's
    causal rows and a draft node's cache-plus-path attention equal the
    reference too (float32)."""
    pool = _pool(4, 2, 64, 16, torch.float32, device, seed=3)
    generator = torch.Generator().manual_seed(4)
    slots = torch.tensor([3, 1], device=device)
    positions = torch.tensor([[10, 11, 12], [40, -1, -1]], device=device)
    queries = torch.randn(2, 3, 2, 4, 16, generator=generator).to(device)  # [G, T, kvh, g, hd]
    got = attend_cached(queries, pool, slots, positions, 64, 0.25, backend="torch")
    want = slot_attention_reference(queries.flatten(2, 3), pool, slots, positions, 64, 0.25)
    rows = positions >= 0
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    path_kv = tuple(torch.randn(2, 3, 2, 2, 16, generator=generator).to(device) for _ in "kv")
    draft_positions = torch.tensor([[50, 50, 50], [60, 60, 60]], device=device)
    ctx = draft_context(pool, slots, 48, backend="torch")
    got = attend_draft(ctx, pool, queries.flatten(2, 3), path_kv, draft_positions, 0.25)
    want = slot_attention_reference(queries.flatten(2, 3), pool, slots, draft_positions, 48,
                                    0.25, path_kv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _ingests(runtime, width: int, device) -> None:
    """Prefills of three requests, decode-like ingests of 1-4 positions
    (batched), and one re-ingest from an earlier position."""
    generator = torch.Generator().manual_seed(5)
    lengths = {"a": 6, "b": 70, "c": 3}  # b spans two key blocks
    rows = lambda n: (torch.randn(n, width, generator=generator).to(device),  # noqa: E731
                      torch.randint(0, 50, (n,), generator=generator).to(device))
    for req_id, length in lengths.items():
        runtime.ingest(req_id, *rows(length), torch.arange(length))
    for step in [{"a": 2, "b": 1, "c": 4}, {"a": 1, "c": 1, "b": 2}]:
        positions = torch.cat([torch.arange(lengths[r], lengths[r] + n) for r, n in step.items()])
        runtime.ingest_many(list(step), *rows(len(positions)), positions, list(step.values()))
        lengths.update({r: lengths[r] + n for r, n in step.items()})
    runtime.ingest("b", *rows(2), torch.tensor([60, 61]))


def _runtimes(drafter: str, device):
    """Two runtimes over one random drafter (an EAGLE-3 head or an MTP
    layer, float32) on `device`, and the width of its target hidden states."""
    from tests.test_mtp_unit import random_layer
    from tests.test_tree_eagle_unit import _gqa_head
    from vllm_specplug.proposers.draft_layers import MtpDraftLayer
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    torch.manual_seed(3)
    if drafter == "eagle3":
        head, embed, width = _gqa_head(seed=6).to(device), torch.nn.Embedding(50, 32), 48
    else:
        head = MtpDraftLayer(random_layer(6).to(device), torch.randn(100, 32).to(device))
        embed, width = torch.nn.Embedding(100, 32), 32
    embed = embed.to(device)
    return [HeadRuntime(head, embed, attention_backend=b) for b in ("torch", "triton")], width


@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
def test_a_runtime_on_the_kernel_caches_and_drafts_as_on_the_einsums(device, drafter,
                                                                      monkeypatch):
    """Two runtimes over one drafter, one on each attention path: the same
    ingests leave the same caches, and both draft the same trees and chains
    (float32)."""
    from tests.test_tree_eagle_unit import assert_same_caches
    from vllm_specplug.proposers import head_attention

    launches = []
    kernel_call = head_attention.slot_attention
    monkeypatch.setattr(head_attention, "slot_attention",
                        lambda *a, **k: launches.append(k["backend"]) or kernel_call(*a, **k))
    (einsum, kernel), width = _runtimes(drafter, device)
    _ingests(einsum, width, device)
    assert not launches
    _ingests(kernel, width, device)
    assert launches and set(launches) == {"triton"}
    assert_same_caches(einsum, kernel, "abc")
    roots = torch.tensor([1, 2, 3], device=device)
    positions = torch.tensor([9, 62, 8], device=device)
    for shape in [(3, 3, 8), (1, 4, 5)]:
        trees = [r.draft_trees(list("abc"), roots, positions, *shape) for r in (einsum, kernel)]
        assert torch.equal(trees[0].token_ids, trees[1].token_ids), shape
        assert torch.equal(trees[0].parent_ids, trees[1].parent_ids), shape


@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
def test_on_the_kernel_the_key_range_is_only_a_bound(device, drafter):
    """The kernel stops at its rows' positions (read on the device), so a
    drafting pass run at the pool's whole capacity equals, bit for bit, the
    same pass at the tight key range, with a cache that was cut back
    (`_ingests` re-ingests b from position 60): what lets one CUDA graph
    serve every key range (`PassGraphs.positions_bound_keys`)."""
    import dataclasses

    from vllm_specplug.proposers.head_graphs import PassGraphs

    (_, kernel), width = _runtimes(drafter, device)
    _ingests(kernel, width, device)
    pool = kernel.pool
    slots = torch.tensor([pool.slot_of[r] for r in "abc"], device=device)
    tight = int(pool.last_positions[slots.cpu().numpy()].max()) + 1
    assert tight < pool.capacity
    roots = torch.tensor([1, 2, 3], device=device)
    positions = torch.tensor([9, 62, 8], device=device)
    for shape in [(3, 3, 8), (1, 4, 5)]:
        trees = [kernel._draft_pass(slots, roots, positions, num_keys, *shape)
                 for num_keys in (tight, pool.capacity)]
        for field in dataclasses.fields(trees[0]):
            a, b = getattr(trees[0], field.name), getattr(trees[1], field.name)
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b, (shape, field.name)
    assert PassGraphs(positions_bound_keys=True).key_range(tight, pool.capacity) == pool.capacity
    assert PassGraphs().key_range(tight, pool.capacity) == 64 < pool.capacity
