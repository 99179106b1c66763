"""Tree attention through PyTorch FlexAttention: the alternative our Triton
kernel (`tree_attention.py`) is measured against.

Built the way vLLM 0.32's FlexAttention backend (v1/attention/backends/
flex_attention.py) attends over its paged cache: queries are the step's rows
[1, H, T, D]; keys/values are the whole cache flattened to
[1, KVH, num_blocks * block_size, D], so `kv_idx` is a physical slot. The
`mask_mod` maps the query row to its request (`doc_ids`) and the physical
slot to the request's logical position (`physical_to_logical`), then applies
the tree rule of `tree_attention_reference`: position < seq_len (the prefix),
or seq_len + j for j an ancestor-or-self of the row's node. The block mask
lists, per 16-row query block, the pages of the requests in it (vLLM's
"direct build", `BlockMask.from_kv_blocks`), so the kernel reads only those.
One mask serves every layer of a step.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from vllm_specplug.verification.metadata import MASK_WORD_BITS
from vllm_specplug.verification.tree_attention import TreeAttentionMetadata

NO_LOGICAL_BLOCK = -1  # physical_to_logical entry of a page the request does not own
Q_BLOCK_SIZE = 16  # query rows per block-mask row (vLLM's direct-build default)
_compiled: dict[str, object] = {}  # torch.compile'd flex_attention / create_block_mask


@dataclass
class TreeFlexMask:
    """Everything one step's `tree_attention_flex` calls share (all layers)."""
    block_mask: BlockMask  # seq_lengths (T, num_blocks * block_size)
    tree_rows: torch.Tensor  # [T] bool, rows that belong to a tree (written back)


def build_tree_block_mask(meta: TreeAttentionMetadata, block_table: torch.Tensor,
                          num_tokens: int, num_blocks: int, block_size: int, device,
                          compile: bool = False, direct: bool = True,
                          q_block_size: int = Q_BLOCK_SIZE) -> TreeFlexMask:
    """Block mask over T = `num_tokens` query rows x num_blocks * block_size
    physical slots. block_table [R, max_blocks] int32; meta as for
    `tree_attention`. `direct`: list pages from the block table (no mask
    evaluation, sync-free); else evaluate `mask_mod` everywhere with
    create_block_mask (torch.compile'd when `compile`, like vLLM's
    create_block_mask_compiled), which also finds fully visible blocks."""
    meta = TreeAttentionMetadata(**{k: t.to(device) for k, t in vars(meta).items()})
    block_table = block_table.to(device)
    num_requests = meta.num_nodes.shape[0]
    # Request row `num_requests` is the sentinel: no pages, seq_len 0, no
    # nodes. Rows outside every tree map to it, see no key, and come out of
    # flex as zeros or NaN; they are never copied back (TreeFlexMask.tree_rows).
    kv_lens = torch.where(meta.num_nodes > 0, meta.seq_lens + meta.num_nodes, 0)
    kv_lens = _with_sentinel(kv_lens, 0)
    doc_ids, row_bits = _row_tables(meta, num_tokens)
    physical_to_logical = _physical_to_logical(block_table, kv_lens, block_size, num_blocks)
    mask_mod = _tree_mask_mod(doc_ids, row_bits, physical_to_logical,
                              _with_sentinel(meta.seq_lens, 0),
                              _with_sentinel(meta.num_nodes, 0), block_size)
    kv_len = num_blocks * block_size
    if direct:
        pages = _request_pages(doc_ids, block_table, kv_lens, block_size, num_blocks)
        block_mask = _block_mask_from_pages(pages, num_blocks, mask_mod, q_block_size,
                                            block_size, (num_tokens, kv_len))
    else:
        build = _compiled_fn("create_block_mask", create_block_mask) if compile else \
            create_block_mask
        block_mask = build(mask_mod, 1, 1, num_tokens, kv_len, device=device,
                           BLOCK_SIZE=(q_block_size, block_size))
    return TreeFlexMask(block_mask, doc_ids < num_requests)


def _with_sentinel(per_request: torch.Tensor, value: int) -> torch.Tensor:
    """[R] -> [R + 1]: the sentinel request's entry appended."""
    return torch.cat([per_request, per_request.new_full((1,), value)])


def _row_tables(meta: TreeAttentionMetadata, num_tokens: int):
    """doc_ids [T] int32 (request of each query row, sentinel R outside trees)
    and row_bits [T, W] int32 (the row's node's ancestor words). Scattered
    from the [R, N] node grid without a host sync; dead nodes land in the
    extra row T, which is dropped."""
    num_requests, max_nodes, _ = meta.ancestor_bits.shape
    node = torch.arange(max_nodes, device=meta.num_nodes.device, dtype=torch.int32)
    live = node[None, :] < meta.num_nodes[:, None]
    rows = torch.where(live, meta.first_token[:, None] + node[None, :], num_tokens).long()
    doc_ids = meta.num_nodes.new_full((num_tokens + 1,), num_requests)
    doc_ids[rows] = torch.arange(num_requests, device=rows.device,
                                 dtype=torch.int32)[:, None].expand_as(rows)
    row_bits = meta.ancestor_bits.new_zeros(num_tokens + 1, meta.ancestor_bits.shape[2])
    row_bits[rows] = meta.ancestor_bits
    return doc_ids[:num_tokens], row_bits[:num_tokens]


def _physical_to_logical(block_table, kv_lens, block_size: int, num_blocks: int):
    """[R + 1, num_blocks] int32: logical block of each physical page in each
    request, NO_LOGICAL_BLOCK if not its page. Only the first
    cdiv(kv_len, block_size) table entries are read (the rest may be
    garbage); a page listed twice keeps its latest logical block (amax), as
    in vLLM's physical_to_logical_mapping."""
    num_requests, max_blocks = block_table.shape
    logical = torch.arange(max_blocks, device=block_table.device)
    used = logical[None, :] < (kv_lens[:num_requests, None] + block_size - 1) // block_size
    pages = torch.where(used, block_table.long(), num_blocks)  # column num_blocks: dump
    table = torch.full((num_requests + 1, num_blocks + 1), NO_LOGICAL_BLOCK,
                       dtype=torch.long, device=block_table.device)
    table[:num_requests].scatter_reduce_(1, pages, logical.expand_as(pages), reduce="amax")
    return table[:, :num_blocks].to(torch.int32)


def _tree_mask_mod(doc_ids, row_bits, physical_to_logical, seq_lens, num_nodes,
                   block_size: int):
    """mask_mod(b, h, q_idx, kv_idx): q_idx a query row, kv_idx a physical slot."""
    max_word = row_bits.shape[1] - 1

    def tree_mask_mod(b, h, q_idx, kv_idx):
        req = doc_ids[q_idx]
        block = physical_to_logical[req, kv_idx // block_size]
        owned = block != NO_LOGICAL_BLOCK
        logical = block * block_size + kv_idx % block_size
        seq_len = seq_lens[req]
        node = logical - seq_len  # tree node j sits at seq_len + j
        in_tree = owned & (node >= 0) & (node < num_nodes[req])
        # Clamped so the gather stays in bounds for slots that are not tree nodes.
        j = node.clamp(min=0)
        word = row_bits[q_idx, (j // MASK_WORD_BITS).clamp(max=max_word)]
        ancestor = ((word >> (j % MASK_WORD_BITS)) & 1) != 0
        return (owned & (logical < seq_len)) | (in_tree & ancestor)

    return tree_mask_mod


def _request_pages(doc_ids, block_table, kv_lens, block_size: int, num_blocks: int):
    """[T, max_blocks] pages each row's request reads; num_blocks past its end."""
    table = torch.cat([block_table, block_table.new_zeros(1, block_table.shape[1])])
    logical = torch.arange(block_table.shape[1], device=block_table.device)
    used = (kv_lens[doc_ids] + block_size - 1) // block_size
    return torch.where(logical[None, :] < used[:, None], table[doc_ids].long(), num_blocks)


def _block_mask_from_pages(pages, num_blocks: int, mask_mod, q_block_size: int,
                           block_size: int, seq_lengths) -> BlockMask:
    """Per query block, the distinct pages of its rows (sorted, deduplicated
    without a host sync), every one partial: mask_mod decides per slot."""
    pad = -pages.shape[0] % q_block_size
    pages = torch.cat([pages, pages.new_full((pad, pages.shape[1]), num_blocks)])
    groups = pages.view(-1, q_block_size * pages.shape[1]).sort(-1).values
    repeat = torch.zeros_like(groups, dtype=torch.bool)
    repeat[:, 1:] = groups[:, 1:] == groups[:, :-1]
    groups = torch.where(repeat, num_blocks, groups).sort(-1).values
    groups = groups[:, :num_blocks]  # no block lists more distinct pages than exist
    live = groups < num_blocks
    # Page 0 as padding, plus one spare column: older flex kernels read
    # kv_indices[kv_num_blocks] unmasked (vLLM keeps the same spare column).
    kv_indices = torch.cat([torch.where(live, groups, 0), groups.new_zeros(groups.shape[0], 1)],
                           dim=1).to(torch.int32)
    kwargs = {"seq_lengths": seq_lengths, "BLOCK_SIZE": (q_block_size, block_size),
              "mask_mod": mask_mod}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        kwargs["compute_q_blocks"] = False  # forward only: skip the transposed index
    return BlockMask.from_kv_blocks(live.sum(-1, dtype=torch.int32)[None, None],
                                    kv_indices[None, None], **kwargs)


def flat_cache(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, KVH, D] -> [1, KVH, num_blocks * block_size, D].
    A view when pages are contiguous (vLLM's flex layout, LBNHC); for the
    head-major layout the CUDA backends use this copies the whole cache."""
    num_kv_heads, head_size = cache.shape[2], cache.shape[3]
    try:
        flat = cache.view(-1, num_kv_heads, head_size)
    except RuntimeError:
        flat = cache.reshape(-1, num_kv_heads, head_size)
    return flat.transpose(0, 1)[None]


def tree_attention_flex(query, key_cache, value_cache, mask: TreeFlexMask, scale: float,
                        output, compile: bool | None = None) -> None:
    """Overwrite the tree rows of `output` [T, H, D] with flex_attention of
    `query` [T, H, D] over the caches [num_blocks, block_size, KVH, D].
    `compile`: torch.compile'd flex (default on CUDA; eager is a dense
    reference implementation that ignores the block sparsity)."""
    if tuple(mask.block_mask.seq_lengths) != (query.shape[0],
                                              key_cache.shape[0] * key_cache.shape[1]):
        raise ValueError(f"block mask is for {mask.block_mask.seq_lengths} (query rows, "
                         f"cache slots), got {query.shape[0]} rows and a cache of "
                         f"{key_cache.shape[0] * key_cache.shape[1]} slots")
    compile = query.is_cuda if compile is None else compile
    attend = _compiled_fn("flex_attention", flex_attention) if compile else flex_attention
    q_block, kv_block = mask.block_mask.BLOCK_SIZE
    # vLLM's options for a direct-built mask: kernel tiles = mask blocks (they
    # must divide them), and the prefill kernel even for short queries.
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": q_block, "BLOCK_N": kv_block}
    out = attend(query.transpose(0, 1)[None], flat_cache(key_cache), flat_cache(value_cache),
                 block_mask=mask.block_mask, scale=scale, enable_gqa=True,
                 kernel_options=options if compile else None)
    out = out[0].transpose(0, 1)
    # torch.where, not boolean indexing: no host sync to count the rows.
    output.copy_(torch.where(mask.tree_rows[:, None, None], out.to(output.dtype), output))


def _compiled_fn(name: str, fn):
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, fullgraph=True)
    return _compiled[name]
