"""CUDA-graph capture sizes for speculative decode steps.

A decode step that verifies K draft tokens per request runs n * (K + 1)
tokens for n requests (for a tree of `num_draft_tokens` nodes, n *
num_draft_tokens, which vLLM sees as K + 1 with K = num_draft_tokens - 1).
vLLM only replays a FULL graph for a uniform decode batch whose size is a
captured multiple of the query length. vLLM 0.32 adds those sizes when it
chooses the capture range itself, but not when the user passes
`max_cudagraph_capture_size` (vllm#54933): then every speculative decode step
that is not a multiple by luck runs eagerly. `decode_capture_sizes` gives
the sizes to add; `patches/config_vllm.py` adds them for our methods.
"""
from __future__ import annotations

import bisect

# vLLM's request-count grid for decode sizes (config/vllm.py, _set_cudagraph_sizes)
SMALL_REQUEST_COUNTS = (1, 2, 4)
FINE_STEP, COARSE_STEP, COARSE_FROM = 8, 16, 256


def request_counts(max_num_reqs: int) -> list[int]:
    """1, 2, 4, 8, 16, ..., 248, 256, 272, ... up to `max_num_reqs` (included)."""
    counts = [n for n in SMALL_REQUEST_COUNTS if n <= max_num_reqs]
    counts += range(FINE_STEP, min(max_num_reqs + 1, COARSE_FROM), FINE_STEP)
    counts += range(COARSE_FROM, max_num_reqs + 1, COARSE_STEP)
    return sorted(set(counts) | {max_num_reqs})


def decode_capture_sizes(query_len: int, max_num_reqs: int, max_size: int) -> list[int]:
    """Token counts n * query_len (n requests of one uniform decode step each)
    that fit under `max_size`; empty when a step is one token per request."""
    if query_len <= 1 or max_size < query_len:
        return []
    return [n * query_len for n in request_counts(max_num_reqs) if n * query_len <= max_size]


def with_decode_sizes(sizes: list[int], query_len: int, max_num_reqs: int) -> list[int]:
    """`sizes` (vLLM's final, sorted capture sizes) plus the decode sizes under
    its largest; the largest stays the largest, as vLLM asserts."""
    if not sizes:
        return sizes
    return sorted(set(sizes) | set(decode_capture_sizes(query_len, max_num_reqs, sizes[-1])))


def eager_decode_warning(query_len: int, max_num_reqs: int, max_size: int) -> str | None:
    """What to tell a user whose `max_cudagraph_capture_size` leaves decode
    steps of more requests than it holds without a graph (None: every decode
    step up to `max_num_reqs` fits). On the H200 a 33-token tree (`topk` 8,
    32 nodes) at 64 requests, 2112 tokens over a 1024 maximum, ran at 0.26x
    vLLM's `eagle3` K=5, which its graphs held
    (docs/results/smollm2_wide_h200_s60)."""
    if query_len <= 1 or max_num_reqs * query_len <= max_size:
        return None
    return (f"vllm-specplug: decode steps of more than {max_size // query_len} requests "
            f"({query_len} tokens each) pass max_cudagraph_capture_size {max_size} and "
            f"run without CUDA graphs, several times slower on a small model; raise "
            f"compilation_config.max_cudagraph_capture_size to {max_num_reqs * query_len} "
            f"(max_num_seqs {max_num_reqs}), or draft less at large batches "
            f"(num_speculative_tokens_per_batch_size, or \"adaptive\": true)")


def with_all_decode_sizes(sizes: list[int], query_len: int, max_num_reqs: int,
                          max_num_tokens: int) -> list[int]:
    """`sizes` plus the decode sizes of every request count of vLLM's grid up
    to `max_num_reqs`, within `max_num_tokens`: vLLM's default keeps decode
    graphs under 512 tokens, which a 16-node tree passes at 33 requests (at
    64 requests our tree's verification ran eagerly, 428 launches a step, on
    the H100: docs/results/v2_tree_h100)."""
    if not sizes or query_len <= 1:
        return sizes
    return sorted(set(sizes) | set(decode_capture_sizes(query_len, max_num_reqs,
                                                        max_num_tokens)))


def add_decode_candidates(candidates: dict, full_descs: list, full_mode) -> int:
    """Model Runner V2's dispatch candidates, with a FULL decode graph of every
    query length for every token count; returns how many were added.

    With dynamic speculative decoding (`num_speculative_tokens_per_batch_size`)
    vLLM captures uniform decode graphs for each query length of the table,
    but gives each token count only the descriptors of the next captured
    token count (`CudaGraphManager._init_candidates`). When that count
    belongs to another query length, a decode step finds no FULL graph and
    runs PIECEWISE: on the H200, 60 requests of a 6-node tree step (360
    tokens) met only a 16-token graph at 368, and 20 of 28 such steps ran
    PIECEWISE (tests/gpu/test_tree_eagle_cuda.py); for a 16/6/3 table, 18 of
    64 batch sizes (tests/test_cudagraph_sizes.py). Each token
    count here also gets, per query length, the smallest FULL graph that can
    hold it, after its own FULL candidates and before the PIECEWISE ones.

    Args:
        candidates: {(num_tokens, num_active_loras): [descriptor]}, in place.
        full_descs: every captured FULL descriptor.
        full_mode: vLLM's `CUDAGraphMode.FULL`.
    """
    by_shape: dict[tuple, list] = {}
    for desc in sorted(full_descs, key=lambda d: d.num_tokens):
        if desc.uniform_token_count is not None:
            shape = (desc.uniform_token_count, desc.num_active_loras, desc.num_ubatches)
            by_shape.setdefault(shape, []).append(desc)
    if len({shape[0] for shape in by_shape}) < 2:  # one query length: nothing shadows
        return 0
    sizes = {shape: [d.num_tokens for d in group] for shape, group in by_shape.items()}
    added = 0
    for (num_tokens, num_loras), descs in candidates.items():
        have = {(d.uniform_token_count, d.num_active_loras, d.num_ubatches) for d in descs}
        extra = [group[i] for shape, group in by_shape.items()
                 if shape[1] == num_loras and shape not in have
                 and (i := bisect.bisect_left(sizes[shape], num_tokens)) < len(group)]
        extra.sort(key=lambda d: d.num_tokens)
        if extra:
            full = [d for d in descs if d.cg_mode == full_mode]
            descs[:] = full + extra + [d for d in descs if d.cg_mode != full_mode]
            added += len(extra)
    return added
