"""The tree step's eager kernels compiled at start-up, not on first requests.

A tree step on Model Runner V2 launches three of our Triton kernels outside
the head's graphs: the greedy walk of the trees (`verify_tree_greedy_rows`),
the accepted path's KV compaction (`compact_kv_layers`) and the verified
rows the head ingests (`verified_rows`, one variant per rows-per-request R
and per chain / tree). vLLM's own warm-up (v1/worker/gpu/warmup.py) runs
decode steps with the sampler's warm-up parameters (log-probs, logits
processors), which our tree sampler serves by its roots-only way, and at
one draft length: on the H200 (JIT_VERBOSE, docs/results/
batch_draft_length_h200_run13) the walk, the compaction and the adaptive
engine's R=2 and R=4 rows compiled on a served engine's first requests
(2-4 s). The speculator's `capture()` runs each here once, on scratch
inputs with the dtypes, widths and alignment a step hands them: every
output goes to scratch, and the slots' trees and the KV caches are only
read (no node is accepted, so compaction moves nothing). The head's
attention is launched there too as its eager ingest launches it
(`warm_up_prefill_attention`: prefills and new requests, outside the
graphs). `ServiceCompiles` then counts what of ours still compiles in
service.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from vllm_specplug.verification.kv_compaction import compact_kv_layers
from vllm_specplug.verification.metadata import NO_NODE
from vllm_specplug.verification.tree_greedy_rows import verify_tree_greedy_rows
from vllm_specplug.verification.tree_rows import rows_per_request, verified_rows

logger = logging.getLogger("vllm_specplug.tree_drafter")

OUR_KERNELS = "vllm_specplug.kernels."  # the modules of our @triton.jit code (kernels/)


def row_variants(lengths: tuple[int, ...], num_steps: int) -> list[tuple[int, bool]]:
    """(R, verifies a tree) of the verified rows at each scheduled draft
    length: a step verifies its root and one node per level, at most
    num_steps + 1 rows, padded to a power of two
    (`SpecplugV2HeadSpeculator._decode_step`); a length of 0 verifies none."""
    return sorted({(rows_per_request(k + 1, num_steps), k > 0) for k in lengths})


class _Scratch:
    """One request's step, in the dtypes Model Runner V2 hands the kernels:
    `num_tokens` input rows, each a logits row, state slot 0."""

    def __init__(self, num_tokens: int, device) -> None:
        int32 = dict(dtype=torch.int32, device=device)
        int64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(num_tokens, **int32)  # [T] int32
        self.target_tokens = torch.zeros(num_tokens, **int64)  # [T] int64
        self.logits_indices = torch.arange(num_tokens, **int64)  # [T] int64
        self.cu_num_logits = torch.tensor([0, num_tokens], **int32)  # [2] int32
        self.query_start_loc = torch.tensor([0, num_tokens], **int32)  # [2] int32
        self.seq_lens = torch.tensor([num_tokens], **int32)  # [1] int32
        self.num_rejected = torch.zeros(1, **int32)  # [1] int32
        self.idx_mapping = torch.zeros(1, **int64)  # [1] int64
        self.batch_rows = torch.zeros(1, **int64)  # [1] int64
        self.last_sampled = torch.zeros(1, **int64)  # [S = 1] int64


def warm_up_tree_kernels(tree_slots, lengths: tuple[int, ...], num_steps: int) -> int:
    """Launch the walk, the compaction (where the caches are bound) and each
    verified-rows variant once; returns the launches.

    Args:
        tree_slots: the speculator's `TreeSlots` (read only).
        lengths: the draft lengths vLLM may schedule (`scheduled_lengths`).
        num_steps: the deepest node a step verifies (`verified_depth`).
    """
    started, num_nodes = time.perf_counter(), tree_slots.num_nodes
    scratch = _Scratch(num_nodes, tree_slots.parents.device)
    accepted = torch.full((1, num_nodes), NO_NODE, dtype=torch.int64,
                          device=scratch.input_ids.device)  # [1, N] int64
    verified = verify_tree_greedy_rows(
        scratch.target_tokens, scratch.input_ids, scratch.logits_indices, scratch.cu_num_logits,
        tree_slots.parents, scratch.idx_mapping, accepted,
        slot_num_nodes=tree_slots.num_drafted, backend="triton")
    launches = 1
    if tree_slots.kv_layers is not None and tree_slots.block_table is not None:
        compact_kv_layers(tree_slots.kv_layers, tree_slots.block_table[:1],
                          scratch.query_start_loc, scratch.seq_lens, accepted,
                          torch.zeros_like(verified.num_accepted), backend="triton")
        launches += 1
    for num_rows, trees in row_variants(lengths, num_steps):
        verified_rows(scratch.batch_rows, scratch.query_start_loc, scratch.seq_lens,
                      scratch.num_rejected, scratch.cu_num_logits, scratch.idx_mapping,
                      accepted if trees else None, scratch.input_ids, scratch.last_sampled,
                      num_rows, backend="triton")
        launches += 1
    logger.info("vllm-specplug: %d launches of the tree step's eager kernels warmed up in "
                "%.1f s", launches, time.perf_counter() - started)
    return launches


def warm_up_prefill_attention(runtime) -> tuple[int, ...]:
    """Launch the head's attention as an eager ingest does (prefills, new
    requests: `HeadRuntime._attend`, slots and positions int64 from host
    arrays) once per row tile it can take; returns the tiles reached.

    The decode steps' graphs (step_warmup.py) launch it with the runner's
    index dtypes, another compiled variant: on the 8B shape (H200) vLLM's
    JIT monitor saw `head_attention_kernel` compile on the first prefill
    in service (docs/results/v2_steps8b_compile_h200). Reads slot 0 of the
    pool, writes only its own output.

    Args:
        runtime: the speculator's `HeadRuntime`, its pool made (None: nothing).
    """
    from vllm_specplug.proposers.head_attention import ROW_TILES, attend_cached, row_tile

    layer, pool = runtime.layer, runtime.pool
    if pool is None:
        return ()
    device, reached = pool.keys.device, []
    for tile in ROW_TILES:
        num_rows = max(1, tile // runtime.group)
        queries = torch.zeros(1, num_rows, layer.num_kv_heads, runtime.group, layer.head_dim,
                              dtype=pool.keys.dtype, device=device)  # [G, T, kvh, g, hd]
        positions = torch.arange(num_rows, dtype=torch.int64, device=device)[None]  # [G, T]
        slots = torch.zeros(1, dtype=torch.int64, device=device)  # [G] int64
        attend_cached(queries, pool, slots, positions, num_rows, runtime.scale,
                      runtime.attention_backend)
        reached.append(row_tile(num_rows, runtime.group))
    return tuple(sorted(set(reached)))


class ServiceCompiles:
    """Our Triton kernels compiled after start-up, by kernel name: each
    stalled the step that first launched it (a compile, or a load from
    Triton's disk cache). Counted by Triton's post-compile hook, which calls
    any hook set before it (vLLM's JIT monitor sets one)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def watch(self) -> None:
        """Count from now on."""
        from triton import knobs

        before = knobs.runtime.jit_post_compile_hook

        def counted(**kwargs):
            self.record(kwargs.get("fn"))
            return before(**kwargs) if before is not None else None

        knobs.runtime.jit_post_compile_hook = counted

    def record(self, fn) -> None:
        """`fn`: the hook's `JitFunctionInfo` (its module's name, the kernel's)."""
        if str(getattr(fn, "module", "")).startswith(OUR_KERNELS):
            self.counts[str(getattr(fn, "name", "?"))] += 1
