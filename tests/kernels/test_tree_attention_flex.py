"""FlexAttention tree attention (the measured alternative to our kernel) ==
`tree_attention_reference`, rows outside trees untouched, and the direct-built
block mask lists every page a visible slot lives in (eager flex on CPU
evaluates mask_mod densely and ignores the block list, so that is checked on
its own)."""
from __future__ import annotations

import shutil

import pytest
import torch

from vllm_specplug.verification.tree_attention import (metadata_from_masks,
                                                       tree_attention_reference, unpack_bits)

from tests.kernels.test_tree_attention import TOLERANCE, paged_case

create_mask = pytest.importorskip(
    "torch.nn.attention.flex_attention",
    reason="this torch has no FlexAttention (torch.nn.attention.flex_attention)").create_mask
from vllm_specplug.verification import tree_attention_flex as flex  # noqa: E402

BLOCK_SIZE = 16
# Eager flex is the dense reference implementation on purpose here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def random_parent_case(num_nodes, seq_lens, heads, kv_heads, head_size, dtype, seed,
                       head_major=True):
    """Trees whose node i hangs off a random earlier node, requests `gaps`
    rows apart, a shuffled block table with garbage past each request's
    pages, and the cache either head-major (vLLM's CUDA backends: flex has to
    copy it) or page-major (vLLM's flex layout: flex reads a view)."""
    generator = torch.Generator().manual_seed(seed)
    batch, max_nodes = len(num_nodes), max(max(num_nodes), 1)
    masks = torch.zeros(batch, max_nodes, max_nodes, dtype=torch.bool)
    for b in range(batch):
        for i in range(num_nodes[b]):
            if i:
                masks[b, i] = masks[b, int(torch.randint(0, i, (1,), generator=generator))]
            masks[b, i, i] = True
    blocks_per_req = (max(seq_lens) + max_nodes) // BLOCK_SIZE + 2
    num_blocks = batch * blocks_per_req + 3
    block_table = torch.randperm(num_blocks, generator=generator)[:batch * blocks_per_req]
    block_table = block_table.view(batch, blocks_per_req).to(torch.int32)
    block_table[:, -1] = 10_000  # garbage: past every request's last page
    shape = (num_blocks, kv_heads, BLOCK_SIZE, 2 * head_size) if head_major else \
        (num_blocks, BLOCK_SIZE, kv_heads, 2 * head_size)
    kv_cache = torch.randn(shape, generator=generator).to(dtype)
    if not head_major:  # keep the logical [blocks, kv_heads, block_size, 2D] view
        kv_cache = kv_cache.transpose(1, 2)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    counts = torch.tensor(num_nodes)
    gaps = torch.randint(1, 4, (batch,), generator=generator)
    first = torch.cumsum(gaps + counts, 0) - counts
    query = torch.randn(int(first[-1] + counts[-1]) + 3, heads, head_size,
                        generator=generator).to(dtype)
    meta = metadata_from_masks(first, seq_lens, masks, counts)
    return query, key_cache, value_cache, block_table, meta


def run_both(case, scale=0.3):
    query, key_cache, value_cache, block_table, meta = case
    want = torch.full_like(query, 7.0)
    tree_attention_reference(query, key_cache, value_cache, block_table, meta, scale, want)
    mask = flex.build_tree_block_mask(meta, block_table, query.shape[0], key_cache.shape[0],
                                      key_cache.shape[1], query.device)
    got = torch.full_like(query, 7.0)
    flex.tree_attention_flex(query, key_cache, value_cache, mask, scale, got, compile=False)
    return got, want, mask


CASES = [  # num_nodes (0: no tree, rows untouched), seq_lens, heads, kv_heads, head_size
    ([5, 0, 13], [3, 40, 16], 4, 2, 32),
    ([9, 40, 1], [31, 0, 17], 4, 1, 24),  # 40 nodes: two ancestor words
    ([0, 7], [5, 50], 4, 2, 16),
]


@pytest.mark.parametrize("head_major", [True, False], ids=["head_major", "page_major"])
@pytest.mark.parametrize("num_nodes,seq_lens,heads,kv_heads,head_size", CASES)
def test_flex_equals_reference_float32(num_nodes, seq_lens, heads, kv_heads, head_size,
                                       head_major):
    case = random_parent_case(num_nodes, seq_lens, heads, kv_heads, head_size,
                              torch.float32, seed=sum(num_nodes), head_major=head_major)
    got, want, mask = run_both(case)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    query, meta = case[0], case[4]
    tree_rows = torch.zeros(query.shape[0], dtype=torch.bool)
    for b in range(meta.num_nodes.shape[0]):
        start = int(meta.first_token[b])
        tree_rows[start:start + int(meta.num_nodes[b])] = True
    assert torch.equal(mask.tree_rows, tree_rows)
    assert torch.equal(got[~tree_rows], torch.full_like(got[~tree_rows], 7.0))


def test_flex_equals_reference_bfloat16():
    case = random_parent_case([6, 0, 11], [20, 3, 33], 4, 2, 32, torch.bfloat16, seed=1)
    got, want, _ = run_both(case)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_flex_on_the_shared_paged_case():
    """The Triton kernel tests' case (reference-built trees, idle request 1)."""
    query, key_cache, value_cache, block_table, meta, _ = paged_case(
        3, 13, 4, 1, 40, BLOCK_SIZE, torch.float32, "cpu", seed=16, idle=[1])
    got, want, _ = run_both((query, key_cache, value_cache, block_table, meta))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_page_major_cache_is_not_copied():
    _, key_cache, *_ = random_parent_case([3], [5], 2, 2, 16, torch.float32, seed=0,
                                          head_major=False)
    flat = flex.flat_cache(key_cache)
    assert flat.shape == (1, 2, key_cache.shape[0] * BLOCK_SIZE, 16)
    assert flat.data_ptr() == key_cache.data_ptr()


def listed_blocks(block_mask, num_blocks):
    """[query blocks, num_blocks] bool: kv block listed (partial or full)."""
    listed = torch.zeros(block_mask.kv_num_blocks.shape[-1], num_blocks, dtype=torch.bool)
    for counts, indices in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if counts is None:
            continue
        for q_block, count in enumerate(counts[0, 0].tolist()):
            listed[q_block, indices[0, 0, q_block, :count].long()] = True
    return listed


@pytest.mark.parametrize("num_nodes,seq_lens,heads,kv_heads,head_size", CASES)
def test_direct_block_mask_lists_every_visible_page(num_nodes, seq_lens, heads, kv_heads,
                                                    head_size):
    """Every visible (row, slot) pair lies in a listed block, and the dense
    create_block_mask path agrees with the direct one where it matters."""
    query, key_cache, _, block_table, meta = random_parent_case(
        num_nodes, seq_lens, heads, kv_heads, head_size, torch.float32, seed=3)
    args = (meta, block_table, query.shape[0], key_cache.shape[0], BLOCK_SIZE, "cpu")
    direct = flex.build_tree_block_mask(*args).block_mask
    visible = create_mask(direct.mask_mod, 1, 1, *direct.seq_lengths, device="cpu")[0, 0]
    listed = listed_blocks(direct, key_cache.shape[0])
    rows, slots = visible.nonzero(as_tuple=True)
    assert listed[rows // flex.Q_BLOCK_SIZE, slots // BLOCK_SIZE].all()
    # Each tree row sees exactly its prefix and its root path; other rows nothing.
    path_lengths = [int(unpack_bits(meta.ancestor_bits[b, :n], n).sum()) if n else 0
                    for b, n in enumerate(num_nodes)]
    assert int(visible.sum()) == sum(n * s + p for n, s, p in
                                     zip(num_nodes, seq_lens, path_lengths, strict=True))
    dense = flex.build_tree_block_mask(*args, direct=False).block_mask
    assert (listed_blocks(dense, key_cache.shape[0]) <= listed).all()


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile of flex_attention on CPU needs a C++ compiler")
def test_compiled_flex_reads_only_listed_pages():
    """Compiled flex (Inductor's CPU template) walks the block list, unlike
    eager flex: a missing page would show here. Page-major cache, as on GPU."""
    case = random_parent_case([5, 0, 13], [3, 40, 16], 4, 2, 32, torch.float32, seed=18,
                              head_major=False)
    query, key_cache, value_cache, block_table, meta = case
    want = torch.full_like(query, 7.0)
    tree_attention_reference(query, key_cache, value_cache, block_table, meta, 0.3, want)
    mask = flex.build_tree_block_mask(meta, block_table, query.shape[0], key_cache.shape[0],
                                      BLOCK_SIZE, "cpu")
    got = torch.full_like(query, 7.0)
    flex.tree_attention_flex(query, key_cache, value_cache, mask, 0.3, got, compile=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
