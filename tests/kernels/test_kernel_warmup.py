"""The tree step's eager kernels warmed up at start-up
(integration/v2/kernel_warmup.py): each launched once, on scratch inputs,
and nothing of the slots' trees or the KV caches written; the head's
attention launched as its eager ingest launches it, at every row tile."""
from __future__ import annotations

import torch

from vllm_specplug.integration.v2.kernel_warmup import (row_variants, warm_up_prefill_attention,
                                                        warm_up_tree_kernels)
from vllm_specplug.integration.v2.tree_slots import TreeSlots


def test_row_variants_are_those_of_each_scheduled_length():
    """R is the verified rows per request padded to a power of two (root and
    one node per level, at most the tree's depth + 1); a length of 0
    verifies no tree. The 16-node tree of 4 levels under the batch policy
    (0, 1, 2, 4, 8, 15) meets four variants; the static tree one."""
    assert row_variants((0, 1, 2, 4, 8, 15), 4) == [(1, False), (2, True), (4, True), (8, True)]
    assert row_variants((15,), 4) == [(8, True)]
    assert row_variants((3, 31), 8) == [(4, True), (16, True)]


def test_warm_up_launches_each_kernel_and_writes_nothing_it_reads(device):
    slots = TreeSlots(max_num_reqs=3, num_nodes=8, device=device)
    slots.parents[1] = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3])  # a tree in slot 1
    slots.num_drafted[0] = 5
    physical = [torch.randn(6, 4, 2, 8, device=device) for _ in range(2)]  # [blocks, size, heads, 2d]
    slots.bind_kv_caches([cache.transpose(1, 2) for cache in physical])
    slots.block_table = torch.randint(0, 6, (3, 5), dtype=torch.int32, device=device)
    before = {name: getattr(slots, name).clone() for name in
              ("parents", "depths", "bits", "num_drafted", "accepted_nodes", "block_table")}
    caches = [cache.clone() for cache in physical]

    launches = warm_up_tree_kernels(slots, (0, 1, 2, 4, 7), num_steps=4)

    assert launches == 1 + 1 + 4  # walk, compaction, R = 1, 2, 4, 8
    for name, value in before.items():
        assert torch.equal(getattr(slots, name), value), name
    for cache, copy in zip(physical, caches):
        assert torch.equal(cache, copy)
    slots.kv_layers = None  # caches not bound: no compaction
    assert warm_up_tree_kernels(slots, (7,), num_steps=4) == 1 + 1


def test_the_heads_prefill_attention_is_warmed_as_an_eager_ingest_launches_it(device,
                                                                               monkeypatch):
    """Each launch is keyed as Triton keys its compiled variants here: the
    index dtypes and the row tile (BLOCK_M). The warm-up launches every row
    tile with the dtypes of an eager ingest (prefills: int64 slots and
    positions from host arrays), so a new request's prefill finds its
    variant compiled; the pool is only read."""
    from tests.kernels.test_head_attention import _ingests, _runtimes
    from vllm_specplug.proposers import head_attention

    (_, kernel), width = _runtimes("eagle3", device)
    launches = []

    def recorded(queries, pool, slots, positions, *args, **kwargs):
        launches.append((slots.dtype, positions.dtype, kwargs["backend"],
                         head_attention.row_tile(queries.shape[1], kernel.group)))
        return call(queries, pool, slots, positions, *args, **kwargs)

    call = head_attention.slot_attention
    monkeypatch.setattr(head_attention, "slot_attention", recorded)
    assert warm_up_prefill_attention(kernel) == ()  # no pool yet: nothing to read
    _ingests(kernel, width, device)
    prefills = set(launches)
    pool = kernel.pool
    before = [torch.as_tensor(t).clone() for t in
              (pool.keys, pool.values, pool.valid, pool.last_positions)]
    launches.clear()
    assert warm_up_prefill_attention(kernel) == head_attention.ROW_TILES == (16, 32, 64)
    assert len(launches) == 3 and prefills <= set(launches), (prefills, launches)
    after = (pool.keys, pool.values, pool.valid, pool.last_positions)
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b))
               for a, b in zip(before, after))


def test_service_compiles_count_our_kernels_and_keep_the_hook_before(monkeypatch):
    """Triton's post-compile hook counts our kernels by name (modules under
    vllm_specplug.kernels) and calls the hook set before it (vLLM's JIT
    monitor's), for every kernel. Under the interpreter Triton compiles
    nothing, so the hook is called here as Triton calls it."""
    from types import SimpleNamespace

    from triton import knobs

    from vllm_specplug.integration.v2.kernel_warmup import ServiceCompiles

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook",
                        lambda **kwargs: seen.append(kwargs["fn"].name))
    compiles = ServiceCompiles()
    compiles.watch()
    hook = knobs.runtime.jit_post_compile_hook
    for module, name in (("vllm_specplug.kernels.tree_rows", "verified_rows_kernel"),
                         ("vllm_specplug.kernels.tree_rows", "verified_rows_kernel"),
                         ("vllm.v1.attention.ops.triton_unified_attention",
                          "kernel_unified_attention")):
        hook(key=None, repr="", fn=SimpleNamespace(module=module, name=name), compile={},
             is_manual_warmup=False, already_compiled=False)
    assert dict(compiles.counts) == {"verified_rows_kernel": 2}
    assert seen == ["verified_rows_kernel", "verified_rows_kernel", "kernel_unified_attention"]
