"""The rows a Model Runner V2 step at 0 drafts keeps for the head
(integration/v2/deferred_rows.py): ingested in one flush, they leave the
head's cache and last output as ingesting each step's rows as it came does."""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.integration.v2.deferred_rows import DeferredRows
from vllm_specplug.verification.tree_rows import VerifiedRows


def _runtimes(count: int):
    from vllm_specplug.models.heads import build_head
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    head = load_head(build_head("tiny-eagle3"))
    embed = torch.nn.Embedding(head.config.vocab_size, head.config.hidden_size)
    runtimes = [HeadRuntime(head, embed) for _ in range(count)]
    for runtime in runtimes:
        runtime.make_pool(4, torch.float32, "cpu")
    return runtimes, head.config.target_hidden_size * len(head.config.aux_layer_ids)


def _step_rows(slots, first_positions, counts, num_rows, width, generator):
    """A step's verified rows as `verified_rows` lays them out: request b
    verified counts[b] positions from first_positions[b], padded to
    `num_rows` by repeating its last; and the same rows unpadded."""
    take = [b * num_rows + min(r, c - 1) for b, c in enumerate(counts) for r in range(num_rows)]
    hidden = torch.randn(len(slots) * num_rows, width, generator=generator)[take]
    next_ids = torch.randint(0, 100, (len(slots) * num_rows,), generator=generator)[take]
    positions = torch.tensor([[f + min(r, c - 1) for r in range(num_rows)]
                              for f, c in zip(first_positions, counts)])
    cuts = torch.tensor(first_positions)
    rows = VerifiedRows(torch.zeros_like(next_ids), positions, next_ids, torch.tensor(slots),
                        cuts, torch.zeros_like(cuts), cuts + torch.tensor(counts))
    return rows, hidden


def test_kept_rows_ingested_at_once_equal_ingesting_them_step_by_step():
    """Three steps of slots 1 and 3 (3 + 1 rows, right after a step that
    verified drafts; then 1 + 1 twice) ingested as they come on one runtime,
    kept and flushed in one pass on the other: the same cache, validity and
    last output and logits. A flush empties the store."""
    (stepwise, kept), width = _runtimes(2)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randn(12, width, generator=generator)
    prefix_ids = torch.randint(0, 100, (12,), generator=generator)
    for runtime in (stepwise, kept):  # both cache positions 0..5 of slots 1 and 3
        runtime.ingest_slots(np.array([1, 3]), np.array([True, True]), prefix, prefix_ids,
                             np.array([0, 1, 2, 3, 4, 5] * 2), [6, 6])
    store = DeferredRows(4, torch.device("cpu"), max_rows=8)
    slots = np.array([1, 3])
    steps = [([6, 6], [3, 1], 4), ([9, 7], [1, 1], 1), ([10, 8], [1, 1], 1)]
    for first, counts, num_rows in steps:
        rows, hidden = _step_rows([1, 3], first, counts, num_rows, width, generator)
        stepwise.ingest_padded(rows.slots, hidden, rows.next_ids, rows.positions, rows.cuts,
                               max_position=int(rows.positions.max()))
        assert store.has_room(slots, num_rows)
        store.keep(rows, hidden, slots)
    assert store.count.tolist() == [0, 5, 0, 3] and store.bound.tolist() == [0, 6, 0, 6]
    assert not store.has_room(slots, 4) and store.has_room(slots, 2)
    store.flush(kept, np.array([0, 1, 2, 3]), max_position=10)
    assert store.num_flushes == 1 and store.num_kept_steps == 3
    assert not store.count.any() and not store.bound.any()
    a, b = stepwise.pool, kept.pool
    assert torch.equal(a.valid, b.valid) and a.valid[1, :11].all() and a.valid[3, :9].all()
    for name in ("keys", "values", "last_out", "last_logits"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), atol=1e-5, rtol=1e-5)


def test_a_flush_leaves_slots_without_kept_rows_alone_and_drop_forgets():
    """Only slots that kept rows are ingested (a slot with none would get
    its last output overwritten); `drop` forgets a slot's rows (a new
    request there, or a prefill)."""
    (runtime,), width = _runtimes(1)
    generator = torch.Generator().manual_seed(1)
    runtime.ingest_slots(np.array([0, 2]), np.array([True, True]),
                         torch.randn(8, width, generator=generator),
                         torch.randint(0, 100, (8,), generator=generator),
                         np.array([0, 1, 2, 3] * 2), [4, 4])
    before = runtime.pool.last_out.clone()
    store = DeferredRows(4, torch.device("cpu"), max_rows=4)
    rows, hidden = _step_rows([0], [4], [1], 1, width, generator)
    store.keep(rows, hidden, np.array([0]))
    rows, hidden = _step_rows([2], [4], [2], 2, width, generator)
    store.keep(rows, hidden, np.array([2]))
    store.drop(np.array([2]))
    assert store.count.tolist() == [1, 0, 0, 0] and store.bound.tolist() == [1, 0, 0, 0]
    store.flush(runtime, np.array([0, 2]), max_position=4)
    assert not torch.equal(runtime.pool.last_out[0], before[0])
    assert torch.equal(runtime.pool.last_out[2], before[2])
    assert runtime.pool.valid[0, :5].all() and not runtime.pool.valid[2, 4:].any()
    store.flush(runtime, np.array([0, 2]), max_position=4)  # nothing kept: nothing ingested
    assert store.num_flushes == 1


def test_rows_padded_by_repeating_the_last_request_are_kept_once():
    """A fused step's rows come padded to a capture size by repeating the
    last request: kept, they leave the store as the unpadded rows do (the
    count is set, not added to, so a slot listed twice counts once)."""
    (runtime,), width = _runtimes(1)
    generator = torch.Generator().manual_seed(2)
    rows, hidden = _step_rows([0, 2], [4, 7], [2, 1], 2, width, generator)
    stores = [DeferredRows(4, torch.device("cpu"), max_rows=4) for _ in range(2)]
    stores[0].keep(rows, hidden, np.array([0, 2]))
    take = torch.tensor([0, 1, 1, 1])  # two requests padded to four
    flat = torch.tensor([0, 1, 2, 3, 2, 3, 2, 3])
    padded = VerifiedRows(rows.token_rows[flat], rows.positions[take], rows.next_ids[flat],
                          rows.slots[take], rows.cuts[take], rows.root_ids[take],
                          rows.root_positions[take])
    stores[1].keep(padded, hidden[flat], np.array([0, 2]))
    assert stores[1].count.tolist() == stores[0].count.tolist() == [2, 0, 1, 0]
    for name in ("positions", "next_ids", "hidden"):  # the spare column aside
        assert torch.equal(getattr(stores[1], name)[:, :4], getattr(stores[0], name)[:, :4]), name


def test_the_start_up_warm_up_leaves_the_store_empty():
    """`warm_up_kept_rows` runs the keep pass at every padded batch size and
    kept row count, and the flush, on placeholder rows in the fused step's
    buffers (captured as graphs on CUDA; run eagerly here): the store is
    empty after it, as service expects."""
    from types import SimpleNamespace

    from vllm_specplug.integration.v2.step_inputs import StepInputs
    from vllm_specplug.integration.v2.step_warmup import kept_row_counts, warm_up_kept_rows

    (runtime,), width = _runtimes(1)
    store = DeferredRows(4, torch.device("cpu"), max_rows=8)
    speculator = SimpleNamespace(runtime=runtime, deferred=store, max_num_reqs=4,
                                 step_inputs=StepInputs(4, 8, torch.device("cpu")),
                                 drafter=SimpleNamespace(options=SimpleNamespace(
                                     num_steps=4, verified_depth=4)))
    # what an earlier step left in the buffers: no token id (a flush would
    # embed it; on CUDA, a device-side assert at start-up)
    speculator.step_inputs.buffers.next_ids.fill_(10 ** 6)
    assert kept_row_counts((0, 1, 2, 4, 8, 15), 4) == [1, 8]
    # the one formula the keep, the fused step and the kernel warm-up share:
    # the root and a node a level, at most num_steps + 1, to a power of two
    from vllm_specplug.verification.tree_rows import rows_per_request

    assert [rows_per_request(n, 4) for n in (1, 2, 3, 5, 6, 16)] == [1, 2, 4, 8, 8, 8]
    assert [rows_per_request(n, 1) for n in (1, 2, 3)] == [1, 2, 2]
    assert warm_up_kept_rows(speculator, (0, 4, 15), width, torch.float32) == 3 * 3
    assert not store.count.any() and not store.bound.any() and store.num_kept_steps == 0
    assert store.hidden.shape == (4, 9, width)
