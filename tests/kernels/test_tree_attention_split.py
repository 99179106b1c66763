"""Split tree attention (prefix part + tree part merged by log-sum-exp):
the composition equals plain attention under each request's mask, the
kernel equals its reference, and padding rows stay untouched."""
from __future__ import annotations

import pytest
import torch

from vllm_specplug.verification.tree_attention import (metadata_from_masks,
                                                       tree_attention_reference)
from vllm_specplug.verification.tree_attention_split import (prefix_attention_reference,
                                                             prefix_lens_of,
                                                             tree_part_attention_reference,
                                                             tree_part_attention_triton)

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
MAX_NODES = 6
# per request: (query tokens, cached before them, parents if a tree)
REQUESTS = [
    (6, 9, [-1, 0, 0, 1, 2, 1]),   # a tree: node 2 must not see node 1
    (4, 3, None),                  # a chain: causal
    (1, 12, None),                 # a plain decode
    (5, 0, None),                  # a first prefill chunk: no prefix at all
    (6, 20, [-1, 0, 1, 1, 0, 4]),  # another tree, longer prefix
    (0, 0, None),                  # a padding row of a captured batch
]


def ancestor_masks(parents) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_case(heads, kv_heads, head_size, block_size, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    sizes = [n for n, _, _ in REQUESTS]
    seq_lens = torch.tensor([n + p if n else 0 for n, p, _ in REQUESTS], dtype=torch.int32)
    query_start = torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    blocks_per_req = int(seq_lens.max()) // block_size + 1
    num_blocks = len(REQUESTS) * blocks_per_req + 3
    block_table = torch.randperm(num_blocks, generator=generator)[:len(REQUESTS) * blocks_per_req]
    block_table = block_table.view(len(REQUESTS), blocks_per_req).to(torch.int32)
    kv_cache = torch.randn(num_blocks, kv_heads, block_size, 2 * head_size,
                           generator=generator).to(dtype).to(device)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    query = torch.randn(int(query_start[-1]) + 2, heads, head_size,
                        generator=generator).to(dtype).to(device)
    dense = torch.zeros(len(REQUESTS), MAX_NODES, MAX_NODES, dtype=torch.bool)
    tree_nodes = torch.zeros(len(REQUESTS), dtype=torch.int32)
    for b, (n, _, parents) in enumerate(REQUESTS):
        if parents is not None:
            dense[b, :n, :n] = ancestor_masks(parents)
            tree_nodes[b] = n
    meta = metadata_from_masks(query_start[:-1], seq_lens - torch.tensor(sizes), dense.to(device),
                               tree_nodes)
    return (query, key_cache, value_cache, block_table.to(device), query_start.to(device),
            seq_lens.to(device), meta)


def expected(case, scale):
    """Trees: `tree_attention_reference`; the rest: causal attention."""
    query, key_cache, value_cache, block_table, query_start, seq_lens, meta = case
    want = torch.full_like(query, 7.0)
    causal = meta.__class__(meta.first_token, meta.seq_lens,
                            torch.tensor([n for n, _, _ in REQUESTS], dtype=torch.int32,
                                         device=query.device),
                            metadata_from_masks(
                                meta.first_token, meta.seq_lens,
                                torch.ones(len(REQUESTS), MAX_NODES, MAX_NODES, dtype=torch.bool,
                                           device=query.device).tril(), meta.num_nodes
                            ).ancestor_bits)
    tree_attention_reference(query, key_cache, value_cache, block_table, causal, scale, want)
    tree_attention_reference(query, key_cache, value_cache, block_table, meta, scale, want)
    return want


def split(case, scale, part) -> torch.Tensor:
    query, key_cache, value_cache, block_table, query_start, seq_lens, meta = case
    output = torch.full_like(query, 7.0)
    lse = prefix_attention_reference(query, key_cache, value_cache, block_table, query_start,
                                     prefix_lens_of(query_start, seq_lens), scale, output)
    part(query, key_cache, value_cache, block_table, query_start, seq_lens, meta.num_nodes,
         meta.ancestor_bits, scale, output, lse)
    return output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", [(4, 2, 16, 4), (6, 2, 40, 8)])
def test_split_attention_equals_masked_attention(device, dtype, heads, kv_heads, head_size,
                                                 block_size):
    case = make_case(heads, kv_heads, head_size, block_size, dtype, device,
                     seed=heads + head_size)
    want = expected(case, 0.3)
    for part in (tree_part_attention_reference, tree_part_attention_triton):
        got = split(case, 0.3, part)
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])
    # rows past the requests' queries are never written
    assert torch.equal(got[-2:], torch.full_like(got[-2:], 7.0))


def test_the_tree_part_reads_the_tree_mask(device):
    """Read as a chain (no tree rows), the first tree's node 2 would see its
    elder sibling, node 1: the outputs must differ there, and only at rows
    whose ancestors are not all their predecessors."""
    case = make_case(4, 2, 16, 4, torch.float32, device)
    query, key_cache, value_cache, block_table, query_start, seq_lens, meta = case
    as_tree = split(case, 0.3, tree_part_attention_triton)
    chains = (*case[:-1], meta.__class__(meta.first_token, meta.seq_lens,
                                         torch.zeros_like(meta.num_nodes), meta.ancestor_bits))
    as_chain = split(chains, 0.3, tree_part_attention_triton)
    differs = (as_tree - as_chain).abs().amax(dim=(1, 2)) > 1e-4
    # tree 0, parents [-1, 0, 0, 1, 2, 1]: rows 0 and 1 see all their predecessors
    assert differs[:6].tolist() == [False, False, True, True, True, True]
    assert not differs[6:16].any()  # the chain, decode and prefill rows are unchanged


def test_tiles_sized_by_the_steps_longest_query(device):
    """Slots sized for 16-node trees, a step of at most 6 query tokens: the
    kernel's tiles follow the step (`max_query_len`), the result does not."""
    from functools import partial

    from vllm_specplug.verification.tree_attention import TreeAttentionMetadata

    case = make_case(4, 2, 16, 4, torch.float32, device)
    meta = case[-1]
    wide = TreeAttentionMetadata(meta.first_token, meta.seq_lens, meta.num_nodes,
                                 torch.nn.functional.pad(meta.ancestor_bits, (0, 0, 0, 10)))
    want = expected(case, 0.3)
    for most in (None, MAX_NODES):
        got = split((*case[:-1], wide), 0.3,
                    partial(tree_part_attention_triton, max_query_len=most))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_prefix_lens_skip_padding_rows():
    query_start = torch.tensor([0, 3, 4, 4, 4], dtype=torch.int32)
    seq_lens = torch.tensor([10, 5, 0, 0], dtype=torch.int32)
    assert prefix_lens_of(query_start, seq_lens).tolist() == [7, 4, 0, 0]


def flash_stand_in(impl, query, key_cache, value_cache, attn_metadata, prefix_lens, out):
    """What `flash_prefix_attention` computes, in plain PyTorch."""
    return prefix_attention_reference(query, key_cache, value_cache, attn_metadata.block_table,
                                      attn_metadata.query_start_loc, prefix_lens, impl.scale,
                                      out)


def fa3_layer(case, **metadata_overrides):
    """A FlashAttention 3 impl with split tree attention attached, and a step's
    metadata, as `FlashAttentionImpl.forward` gets them."""
    from types import SimpleNamespace

    from vllm_specplug.integration.cuda_tree_attention import TREE_ROWS_ATTR

    query, key_cache, value_cache, block_table, query_start, seq_lens, meta = case
    buffers = SimpleNamespace(split_attention=True, metadata=meta, split_layers=0)
    impl = SimpleNamespace(num_heads=query.shape[1], num_kv_heads=key_cache.shape[2],
                           head_size=query.shape[2], scale=0.3, sliding_window=(-1, -1),
                           logits_soft_cap=0, alibi_slopes=None, sinks=None,
                           kv_cache_dtype="auto", vllm_flash_attn_version=3,
                           **{TREE_ROWS_ATTR: buffers})
    metadata = SimpleNamespace(**{**dict(
        causal=True, max_query_len=MAX_NODES, query_start_loc=query_start, seq_lens=seq_lens,
        block_table=block_table, num_actual_tokens=int(query_start[-1]), max_seq_len=64,
        max_num_splits=0), **metadata_overrides})
    # the cache as vLLM's logical layout [blocks, kv_heads, block_size, 2 * head_size]
    kv_cache = torch.cat([key_cache, value_cache], dim=-1).transpose(1, 2)
    return impl, metadata, kv_cache


def test_split_forward_serves_a_step_that_fits_the_tree(device):
    from vllm_specplug.integration.cuda_tree_attention import PREFIX_LENS_ATTR, split_forward

    case = make_case(4, 2, 16, 4, torch.float32, device)
    impl, metadata, kv_cache = fa3_layer(case)
    output = torch.full_like(case[0], 7.0).view(case[0].shape[0], -1)
    assert split_forward(impl, case[0].view(output.shape), kv_cache, metadata, output,
                         flash_stand_in)
    want = expected(case, 0.3)
    torch.testing.assert_close(output.view_as(want), want, atol=2e-5, rtol=2e-5)
    # the step's prefix lengths are computed once, for every layer after the first
    assert getattr(metadata, PREFIX_LENS_ATTR).tolist() == [9, 3, 12, 0, 20, 0]


# one query token a request: no tree node (a step at draft length 0), the
# backend's attention as without speculation
@pytest.mark.parametrize("overrides", [dict(max_query_len=MAX_NODES + 1), dict(causal=False),
                                       dict(max_query_len=1)])
@pytest.mark.parametrize("version", [2, 3])
def test_split_forward_leaves_other_steps_to_the_backend(device, overrides, version):
    from vllm_specplug.integration.cuda_tree_attention import split_forward

    case = make_case(4, 2, 16, 4, torch.float32, device)
    impl, metadata, kv_cache = fa3_layer(case, **overrides)
    impl.vllm_flash_attn_version = version
    output = torch.full_like(case[0], 7.0)
    assert not split_forward(impl, case[0], kv_cache, metadata, output,
                             flash_stand_in)
    assert torch.equal(output, torch.full_like(output, 7.0))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU with vLLM's FlashAttention 3 (the real prefix "
                           "call); run on the staged GPU host as docs/gpu.md says")
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", [(9, 3, 64, 16),
                                                                 (32, 8, 128, 16)])
def test_split_forward_with_flash_attention_equals_masked_attention(heads, kv_heads, head_size,
                                                                     block_size):
    """The real FlashAttention 3 prefix call (bf16), merged with our tree
    part, against the float32 reference of the masked attention."""
    from vllm_specplug.integration.cuda_tree_attention import split_forward
    from vllm_specplug.patches.flash_attn import flash_prefix_attention

    case = make_case(heads, kv_heads, head_size, block_size, torch.bfloat16, "cuda")
    impl, metadata, kv_cache = fa3_layer(case)
    impl.scale = head_size ** -0.5
    output = torch.full_like(case[0], 7.0)
    assert split_forward(impl, case[0], kv_cache, metadata, output, flash_prefix_attention)
    want = expected(case, impl.scale)
    torch.testing.assert_close(output.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Triton compiles only on a CUDA GPU (the interpreter compiles "
                           "nothing); run on the staged GPU host as docs/gpu.md says")
def test_the_tree_part_compiles_once_whatever_the_steps_token_count(monkeypatch):
    """The log-sum-exp's head stride is the step's token count: a static
    tree's engine captured multiples of its node count only, and a step of
    another count compiled the kernel again in service (SmolLM2 on the H200,
    docs/results/batch_draft_length_h200_run14). Token counts divisible by
    16, odd and even: none compiles the kernel after the first, and each
    result is right."""
    from triton import knobs

    from vllm_specplug.integration.v2.kernel_warmup import ServiceCompiles

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)  # restored after
    compiles = ServiceCompiles()
    compiles.watch()
    case = make_case(9, 3, 64, 16, torch.bfloat16, "cuda", seed=5)
    query, key_cache, value_cache, block_table, query_start, seq_lens, meta = case
    want = expected(case, 0.125)
    # the first launch may find the kernel compiled by an earlier test of the
    # same shapes; from then on no stride may compile it again
    for width in (32, 33, 34, query.shape[0]):  # the lse's row stride: T, or padded past it
        if width == 33:
            compiles.counts.clear()
        output = torch.full_like(query, 7.0)
        lse = prefix_attention_reference(query, key_cache, value_cache, block_table, query_start,
                                         prefix_lens_of(query_start, seq_lens), 0.125, output)
        padded = torch.zeros(lse.shape[0], width, dtype=lse.dtype, device=lse.device)
        padded[:, :lse.shape[1]] = lse
        tree_part_attention_triton(query, key_cache, value_cache, block_table, query_start,
                                   seq_lens, meta.num_nodes, meta.ancestor_bits, 0.125, output,
                                   padded[:, :lse.shape[1]])
        torch.testing.assert_close(output.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert not compiles.counts, compiles.counts
