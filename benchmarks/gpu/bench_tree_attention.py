"""Our tree-attention kernel alone at Llama-3-8B attention shapes (32 query
heads, 8 KV heads, head size 128, bf16, block size 16, 512 cached tokens per
request), against vLLM's FlashAttention on the same queries with a causal
mask (the work the backend does before ours) and against FlexAttention with
our tree mask (the alternative), on a CUDA GPU:

    python3 benchmarks/gpu/bench_tree_attention.py --out $OUT

`--splits-only` times the default tile without key splits (`nosplit`) and
with the splits `num_key_splits` picks (`default`: split-K at small batches).

`split_ms` is the split way (option `tree_attention="split"`, the default on
FlashAttention 3): FlashAttention over the prefix only, with its
log-sum-exp, then our tree-part kernel over the tree's keys, merged
(`integration/cuda_tree_attention.split_forward` makes the same two calls);
it replaces `flash_causal_ms` + `ours_default_ms` of the rewrite way.
`--shape smollm2` times SmolLM2-135M's layer (9 heads, 3 KV heads, head
size 64) instead of the 8B shape.

Times are CUDA-event means over 50 launches (GPU time, no host overhead), per
layer; a 32-layer model pays 32 of them per step. Tile configurations are
tried so the default can be chosen from data.

The alternative is vLLM's FlexAttention backend with a tree mask
(`vllm_specplug/verification/tree_attention_flex.py`): a block mask built once
per step over the paged cache (`flex_mask_build_ms`: host + GPU wall time of
one build, synchronized, mean of 20), then torch.compile'd flex_attention per
layer (`flex_ms`, CUDA events, including the copy of the tree rows into the
output) and its `flex_max_error` against the reference; `flex_compile_s` is
the first call (Inductor compiles once per query length and cache size).
Flex reads the cache as [1, kv_heads, num_blocks * block_size, head_size],
a view only of vLLM's flex layout (pages contiguous), so flex gets a copy of
the cache in that layout. `--flex-dense` adds the same with the mask
evaluated everywhere by a compiled create_block_mask (`flex_dense_*`), which
also marks fully visible blocks (skipped mask_mod) at a higher build cost.
A failing flex variant prints its error and records None.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SHAPES = {"8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # heads, KV heads, head size
HEADS, KV_HEADS, HEAD_SIZE = SHAPES["8b"]
BLOCK_SIZE, CONTEXT = 16, 512
BATCH_SIZES, NODES = (1, 16, 64), (8, 16, 32, 64)
TILES = [(64, 64, 4), (64, 32, 4), (32, 64, 4), (64, 64, 8), (128, 64, 8), (128, 32, 8)]


def case(batch: int, nodes: int, generator: torch.Generator):
    from vllm_specplug.verification.tree_attention import metadata_from_masks

    blocks_per_req = -(-(CONTEXT + nodes) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req + 1
    table = torch.randperm(num_blocks, generator=generator)[:batch * blocks_per_req]
    table = table.view(batch, blocks_per_req).int().cuda()
    kv_cache = torch.randn(num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE,
                           generator=generator).bfloat16().cuda()
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    masks = torch.zeros(batch, nodes, nodes, dtype=torch.bool)
    for b in range(batch):
        for i in range(nodes):
            parent = int(torch.randint(0, max(i, 1), (1,), generator=generator)) if i else -1
            if parent >= 0:
                masks[b, i] = masks[b, parent]
            masks[b, i, i] = True
    first = torch.arange(batch) * nodes
    meta = metadata_from_masks(first, torch.full((batch,), CONTEXT), masks.cuda(),
                               torch.full((batch,), nodes))
    query = torch.randn(batch * nodes, HEADS, HEAD_SIZE, generator=generator).bfloat16().cuda()
    return query, key_cache, value_cache, table, meta


def gpu_ms(fn, repeats: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def flash_ms(query, key_cache, value_cache, table, batch, nodes) -> float | None:
    """vLLM's FlashAttention (paged, causal) on the same queries."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as error:
        print(f"  FlashAttention unavailable: {error}")
        return None
    cu_q = torch.arange(0, (batch + 1) * nodes, nodes, dtype=torch.int32, device="cuda")
    seqused = torch.full((batch,), CONTEXT + nodes, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    try:  # FA3 is what vLLM runs on an H100
        return gpu_ms(lambda: flash_attn_varlen_func(
            query, key_cache, value_cache, max_seqlen_q=nodes, cu_seqlens_q=cu_q,
            max_seqlen_k=CONTEXT + nodes, seqused_k=seqused, softmax_scale=HEAD_SIZE ** -0.5,
            causal=True, block_table=table, out=out, fa_version=3))
    except Exception as error:  # noqa: BLE001 - the baseline is optional
        print(f"  FlashAttention failed: {type(error).__name__}: {error}")
        return None


def split_row(query, key_cache, value_cache, table, meta, batch, nodes, want) -> dict:
    """The split way: FlashAttention 3 over the prefix (unmasked, with its
    log-sum-exp), then our tree part merged in place."""
    from vllm_specplug.verification.tree_attention_split import tree_part_attention_triton
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as error:
        print(f"  FlashAttention unavailable: {error}")
        return {"split_ms": None, "split_max_error": None}
    cu_q = torch.arange(0, (batch + 1) * nodes, nodes, dtype=torch.int32, device="cuda")
    prefix = torch.full((batch,), CONTEXT, dtype=torch.int32, device="cuda")
    seq_lens = prefix + nodes
    out = torch.empty_like(query)

    def run() -> None:
        _, lse = flash_attn_varlen_func(
            query, key_cache, value_cache, max_seqlen_q=nodes, cu_seqlens_q=cu_q,
            max_seqlen_k=CONTEXT, seqused_k=prefix, softmax_scale=HEAD_SIZE ** -0.5,
            causal=False, block_table=table, out=out, return_softmax_lse=True, fa_version=3)
        if lse.shape[0] != query.shape[1]:
            lse = lse.transpose(0, 1)
        tree_part_attention_triton(query, key_cache, value_cache, table, cu_q, seq_lens,
                                   meta.num_nodes, meta.ancestor_bits, HEAD_SIZE ** -0.5, out,
                                   lse)
    try:
        run()
        error = float((out.float() - want.float()).abs().max())
        return {"split_ms": gpu_ms(run), "split_max_error": error}
    except Exception as error:  # noqa: BLE001 - one way failing must not stop the run
        print(f"  split failed: {type(error).__name__}: {error}")
        return {"split_ms": None, "split_max_error": None}


def wall_ms(fn, repeats: int = 20) -> float:
    """Host + GPU: each call synchronized, as a step that waits for it."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / repeats


def flex_row(name: str, query, key_cache, value_cache, table, meta, want,
             **mask_options) -> dict:
    """`name`_mask_build_ms, _compile_s, _ms, _max_error; None where it failed."""
    from vllm_specplug.verification.tree_attention_flex import (build_tree_block_mask,
                                                                tree_attention_flex)

    row = dict.fromkeys(f"{name}_{key}" for key in
                        ("mask_build_ms", "compile_s", "ms", "max_error"))
    try:
        # vLLM's flex layout keeps each page's slots contiguous ([blocks,
        # block_size, kv_heads, 2 * head_size]): flattening blocks x slots is a view.
        pages = torch.cat([key_cache, value_cache], dim=-1).contiguous()
        key_pages, value_pages = pages.split(HEAD_SIZE, dim=-1)
        build = lambda: build_tree_block_mask(  # noqa: E731
            meta, table, query.shape[0], pages.shape[0], BLOCK_SIZE, query.device,
            **mask_options)
        row[f"{name}_mask_build_ms"] = wall_ms(build)
        mask, out = build(), torch.zeros_like(query)
        run = lambda: tree_attention_flex(  # noqa: E731
            query, key_pages, value_pages, mask, HEAD_SIZE ** -0.5, out, compile=True)
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        row[f"{name}_compile_s"] = time.perf_counter() - start
        row[f"{name}_max_error"] = float((out.float() - want.float()).abs().max())
        row[f"{name}_ms"] = gpu_ms(run)
    except Exception as error:  # noqa: BLE001 - the alternative must not stop the run
        print(f"  {name} failed: {type(error).__name__}: {error}")
    return row


def main() -> None:
    from vllm_specplug.verification.tree_attention import (tree_attention_reference,
                                                           tree_attention_triton)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--flex-dense", action="store_true",
                        help="also time flex with a create_block_mask-built mask")
    parser.add_argument("--splits-only", action="store_true",
                        help="only the default tile, without and with key splits")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                        help="attention layer shape (heads, KV heads, head size)")
    args = parser.parse_args()
    global HEADS, KV_HEADS, HEAD_SIZE
    HEADS, KV_HEADS, HEAD_SIZE = SHAPES[args.shape]
    # Every case is a new shape for Inductor; past the default limit dynamo
    # would fall back to eager flex, which materializes all T x cache scores.
    torch._dynamo.config.recompile_limit = 64
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in BATCH_SIZES:
        for nodes in NODES:
            query, key_cache, value_cache, table, meta = case(batch, nodes, generator)
            want = torch.zeros_like(query)
            tree_attention_reference(query, key_cache, value_cache, table, meta,
                                     HEAD_SIZE ** -0.5, want)
            row = {"batch_size": batch, "nodes": nodes,
                   "flash_causal_ms": flash_ms(query, key_cache, value_cache, table, batch,
                                               nodes)}
            for name, splits in (("nosplit", 1), ("default", None)):
                out = torch.zeros_like(query)
                run = lambda: tree_attention_triton(  # noqa: E731
                    query, key_cache, value_cache, table, meta, HEAD_SIZE ** -0.5, out,
                    num_splits=splits)
                run()
                row[f"ours_{name}_max_error"] = float((out.float() - want.float()).abs().max())
                row[f"ours_{name}_ms"] = gpu_ms(run)
            row.update(split_row(query, key_cache, value_cache, table, meta, batch, nodes,
                                 want))
            for block_m, block_n, warps in ([] if args.splits_only else TILES):
                out = torch.zeros_like(query)
                run = lambda: tree_attention_triton(  # noqa: E731
                    query, key_cache, value_cache, table, meta, HEAD_SIZE ** -0.5, out,
                    block_m=block_m, block_n=block_n, num_warps=warps)
                run()
                error = float((out.float() - want.float()).abs().max())
                row[f"ours_{block_m}x{block_n}_w{warps}_ms"] = gpu_ms(run)
                row[f"ours_{block_m}x{block_n}_w{warps}_max_error"] = error
            flex_args = (query, key_cache, value_cache, table, meta, want)
            if not (args.no_flex or args.splits_only):
                row.update(flex_row("flex", *flex_args))
            if args.flex_dense:
                row.update(flex_row("flex_dense", *flex_args, direct=False, compile=True))
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "tree_attention_kernel" + ("" if args.shape == "8b" else f"_{args.shape}")
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
