"""The head's fused decode-step graphs captured at start-up, not on first use.

`SpecplugV2HeadSpeculator` runs a step where every request decodes as one
graph replay (`HeadRuntime.decode_step`, `proposers/head_graphs.py`), keyed
by (padded batch, verified rows, tree shape). Captured lazily, each new key
stalled its step for 200-450 ms on the H100, where a step takes 2-30 ms; a
batch that drains from 256 requests meets 35 padded sizes, and a policy that
tries other draft lengths (`"adaptive": true`, adaptive/batch_draft_length.py)
meets them once per length (docs/results/batch_draft_length_h100_run2: 38 new
shapes in 367 steps). Model Runner V2 calls its speculator's `capture()`
while it captures its own graphs; there the speculator runs this: one step
per key that service will reach in its steady state, on placeholder inputs,
and then forgets what the placeholder steps wrote (the head's cache, the
trees, the drafts), so that service starts from the state it would have
without them.

vLLM captures its own EAGLE drafting there the same way
(`v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py`, `capture`).
"""
from __future__ import annotations

import logging

import torch

from vllm_specplug.integration import batch_schedule
from vllm_specplug.integration.batch_schedule import table_lengths
from vllm_specplug.proposers.head_graphs import MAX_GRAPHS, STEP_KIND, padded_batch
from vllm_specplug.verification.tree_rows import rows_per_request

logger = logging.getLogger("vllm_specplug.tree_drafter")


def scheduled_lengths(spec_config) -> tuple[int, ...]:
    """The draft lengths vLLM may ask a step for: each of the
    `num_speculative_tokens_per_batch_size` table (also what our batch
    policy's candidates are, integration/batch_schedule.capture_table), or
    `num_speculative_tokens` alone."""
    table = getattr(spec_config, "num_speculative_tokens_per_batch_size", None)
    return table_lengths(table) if table else (int(spec_config.num_speculative_tokens),)


def target_layout(model_config, aux_layer_ids) -> tuple[int, torch.dtype]:
    """Width and dtype of what the head reads of the target per row: its
    auxiliary layers' hidden states side by side (EAGLE-3) or the last hidden
    state (MTP), in the model's dtype. Should service see another layout, the
    graphs captured here are not used (the step's key holds both)."""
    width = model_config.get_hidden_size() * (len(aux_layer_ids) if aux_layer_ids else 1)
    return width, model_config.dtype


def padded_sizes(max_num_reqs: int) -> list[int]:
    """Every padded batch size a step of 1..max_num_reqs requests runs at."""
    return sorted({padded_batch(n) for n in range(1, max_num_reqs + 1)})


def steady_steps(lengths: tuple[int, ...], tree_shape: tuple[int, int, int], step_shape,
                 depth: int | None = None) -> list[tuple[int, tuple[int, int, int]]]:
    """(verified rows per request, tree shape) of a decode step at each length
    when the step before drafted the same length: it verifies the root and
    one node per level, at most `depth` + 1 rows (None: num_steps; deeper
    where a prompt lookup's branch reaches below the tree, `verified_depth`),
    padded to a power of two (`SpecplugV2HeadSpeculator._decode_step`).
    `step_shape` is `step_inputs.step_tree_shape`."""
    return sorted({_step(k, k, tree_shape, step_shape, depth) for k in lengths})


def _step(k_before: int, k_now: int, tree_shape, step_shape,
          depth: int | None = None) -> tuple[int, tuple[int, int, int]]:
    """A step that verifies what was drafted at `k_before` and drafts `k_now`."""
    depth = tree_shape[1] if depth is None else depth
    return (rows_per_request(k_before + 1, depth), step_shape(tree_shape, k_now))


def warm_up_kept_rows(speculator, lengths: tuple[int, ...], width: int,
                      dtype: torch.dtype) -> int:
    """The graphs of a step at 0 drafts (`DeferredRows.warm_up`: the keep
    pass, read from the fused step's persistent buffers, and the flush) at
    every padded batch size; returns how many."""
    inputs = speculator.step_inputs
    return speculator.deferred.warm_up(
        speculator.runtime, lambda size, num_rows: (inputs.rows(size, num_rows),
                                                    inputs.hidden(size * num_rows, width, dtype)),
        padded_sizes(speculator.max_num_reqs),
        kept_row_counts(lengths, speculator.drafter.options.verified_depth), width, dtype)


def kept_row_counts(lengths: tuple[int, ...], num_steps: int) -> list[int]:
    """Rows a request a step at 0 drafts keeps (`DeferredRows.keep`): one
    after a step at 0, and what the longest length verifies right after it;
    a step after another length keeps eagerly, or from the graph of the
    same row count."""
    return sorted({1, rows_per_request(max(lengths) + 1, num_steps)})


def table_of(vllm_config) -> list | None:
    """The user's `num_speculative_tokens_per_batch_size` table, whose K
    follows the batch size; None without one, or under our batch policy
    (its table only lists the lengths to capture: it moves between any two)."""
    table = getattr(vllm_config.speculative_config, "num_speculative_tokens_per_batch_size", None)
    policy = str(getattr(vllm_config.scheduler_config, "scheduler_cls", "") or "")
    return None if policy.startswith(f"{batch_schedule.__name__}.SpecplugBatchDraft") else table


def transition_steps(table, tree_shape: tuple[int, int, int], step_shape, max_num_reqs: int,
                     depth: int | None = None) -> list[tuple[int, int, tuple[int, int, int]]]:
    """(padded batch, verified rows, tree shape) of the steps where a table's
    K changes: the batch grew or drained across an entry's edge, and the step
    verifies the rows drafted at the other entry's K while drafting its own
    (vLLM's test of a table from 5 drafts to 2: the first step at 4 requests
    or fewer verified 2's rows and drafted 5's tree)."""
    entries = sorted((int(lo), int(hi), int(k)) for lo, hi, k in table)
    keys = set()
    for (lo_a, hi_a, k_a), (lo_b, hi_b, k_b) in zip(entries, entries[1:]):
        for k_before, (lo, hi, k_now) in ((k_a, (lo_b, hi_b, k_b)), (k_b, (lo_a, hi_a, k_a))):
            num_rows, shape = _step(k_before, k_now, tree_shape, step_shape, depth)
            keys |= {(padded_batch(n), num_rows, shape)
                     for n in range(lo, min(hi, max_num_reqs) + 1)}
    return sorted(keys)


def step_keys(lengths: tuple[int, ...], table, tree_shape: tuple[int, int, int], step_shape,
              max_num_reqs: int,
              depth: int | None = None) -> list[tuple[int, int, tuple[int, int, int]]]:
    """Every (padded batch, verified rows, tree shape) start-up captures: the
    steady steps of `lengths` at every padded batch size, and a table's
    transitions (`table_of`, None: none); `depth` as `steady_steps`'."""
    keys = {(size, num_rows, shape) for num_rows, shape in steady_steps(lengths, tree_shape,
                                                                       step_shape, depth)
            for size in padded_sizes(max_num_reqs)}
    if table:
        keys |= set(transition_steps(table, tree_shape, step_shape, max_num_reqs, depth))
    return sorted(keys)


def warm_up_step_graphs(speculator, keys: list[tuple[int, int, tuple[int, int, int]]],
                        width: int, dtype: torch.dtype) -> int:
    """Capture the fused step's graph for every (padded batch, verified rows,
    tree shape) of `keys` (`step_keys`), on placeholder inputs (each
    request's rows at positions 0..R-1 of slot i mod S, zero hidden states of
    `width`), then clear the head's cache, the trees and the drafts. Returns
    the number of steps run."""
    # eager (graphs None, as on CPU) they only run: what the test checks
    disabled = _disabled_kinds(speculator)
    was_disabled, count = disabled & {STEP_KIND}, 0
    try:
        for size, num_rows, shape in keys:
            if STEP_KIND in disabled:
                break
            _placeholder_step(speculator, size, num_rows, shape, width, dtype)
            count += 1
    finally:  # also after a failed capture: service starts clean either way
        _forget_placeholders(speculator)
    _enable_again(disabled, was_disabled, (STEP_KIND,))
    return count


def _disabled_kinds(speculator) -> set:
    """The pass kinds the head's graphs gave up capturing (a set that
    `PassGraphs` updates); an empty one when eager (graphs None, as on CPU)."""
    graphs = speculator.runtime.graphs
    return graphs.disabled if graphs is not None else set()


def _enable_again(disabled: set, was_disabled: set, kinds) -> None:
    """Kinds among `kinds` whose capture failed during a warm-up (PassGraphs
    logged why) are tried again on first use in service, as before start-up
    capture existed; kinds disabled before the warm-up stay disabled."""
    for kind in (disabled - was_disabled) & set(kinds):
        disabled.discard(kind)
        logger.warning("vllm-specplug: the head's %s graphs were not captured at start-up; "
                       "they are captured on first use instead", kind)


MIXED_KINDS = ("ingest", "draft")  # the head's passes of a step with prefills


def warm_up_mixed_passes(speculator, keys: list[tuple[int, int, tuple[int, int, int]]],
                         width: int, dtype: torch.dtype) -> int:
    """Capture the two passes a step with prefills runs apart (the decodes'
    padded ingest, then the drafting pass: `SpecplugV2HeadSpeculator._step`)
    for every key of `keys`, on placeholders forgotten afterwards; returns
    the passes run. On the 8B shape (H200) each was captured in service on
    first use, 10-18 ms a stall (docs/results/v2_steps8b_compile_h200).
    Skipped where they would crowd the graphs start-up already holds (the
    fused steps', the kept rows') out of the graphs' LRU (MAX_GRAPHS: a
    policy's many lengths)."""
    graphs = speculator.runtime.graphs
    held = len(graphs.graphs) if graphs is not None else 0
    if held + len(MIXED_KINDS) * len(keys) > MAX_GRAPHS:
        logger.info("vllm-specplug: %d step shapes: the head's passes of steps with prefills "
                    "are captured on first use", len(keys))
        return 0
    disabled = _disabled_kinds(speculator)
    was_disabled, count = disabled & set(MIXED_KINDS), 0
    try:
        for size, num_rows, shape in keys:
            _placeholder_passes(speculator, size, num_rows, shape, width, dtype)
            count += 2
    finally:
        _forget_placeholders(speculator)
    _enable_again(disabled, was_disabled, MIXED_KINDS)
    return count


def _placeholder_passes(speculator, size: int, num_rows: int, shape: tuple[int, int, int],
                        width: int, dtype: torch.dtype) -> None:
    """A step with prefills' two passes for `size` placeholder decodes, in the
    index dtypes service hands them (slots int32 from the runner's
    idx_mapping for the drafting pass)."""
    rows, target = _placeholder_inputs(speculator, size, num_rows, width, dtype)
    runtime = speculator.runtime
    runtime.ingest_padded(rows.slots, target, rows.next_ids, rows.positions, rows.cuts, num_rows)
    runtime.draft_slots(rows.slots.to(torch.int32), rows.root_ids, rows.root_positions,
                        num_rows + 1, *shape)


def _placeholder_inputs(speculator, size: int, num_rows: int, width: int,
                        dtype: torch.dtype):
    """`size` placeholder requests of `num_rows` rows in the speculator's
    persistent buffers (the addresses service replays from), and zero
    hidden states of `width`: (VerifiedRows, [size * num_rows, width])."""
    rows = speculator.step_inputs.rows(size, num_rows)
    _placeholder_rows(speculator, rows, size, num_rows)
    target = speculator.step_inputs.hidden(size * num_rows, width, dtype)
    target.zero_()
    return rows, target


def _placeholder_rows(speculator, rows, size: int, num_rows: int) -> None:
    """Request i in slot i mod S, its rows at positions 0..R-1, its root after."""
    device = speculator.device
    rows.slots.copy_(torch.arange(size, device=device) % speculator.max_num_reqs)
    rows.positions.copy_(torch.arange(num_rows, device=device).expand(size, num_rows))
    rows.cuts.zero_()
    rows.next_ids.zero_()
    rows.root_ids.zero_()
    rows.root_positions.fill_(num_rows)


def _placeholder_step(speculator, size: int, num_rows: int, shape: tuple[int, int, int],
                      width: int, dtype: torch.dtype) -> None:
    """One fused decode step of `size` placeholder requests, in the
    speculator's persistent buffers (the addresses service replays from)."""
    rows, target = _placeholder_inputs(speculator, size, num_rows, width, dtype)
    speculator.runtime.decode_step(rows.slots, target, rows.next_ids, rows.positions, rows.cuts,
                                   rows.root_ids, rows.root_positions, num_rows + 1, shape,
                                   speculator._emit)


def _forget_placeholders(speculator) -> None:
    """What the placeholder steps left: every slot's cache rows (a request new
    to its slot drops them anyway), its tree and its drafts."""
    speculator.runtime.pool.valid.zero_()
    speculator.drafts.zero_()
    if speculator.tree_slots is not None:  # every slot, the padding's spare one too
        speculator.tree_slots.forget(torch.arange(speculator.tree_slots.max_num_reqs,
                                                  device=speculator.device))
