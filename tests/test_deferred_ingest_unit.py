"""`DeferredIngest` (integration/v1/deferred_ingest.py): a request's kept-back
verified rows come back oldest first, before the step's own, once; rows of a
request that ends are counted as never ingested; a request keeps at most
MAX_DEFERRED_ROWS rows back."""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.integration.v1.deferred_ingest import MAX_DEFERRED_ROWS, DeferredIngest


def _rows(first: int, n: int):
    positions = np.arange(first, first + n, dtype=np.int64)
    return torch.arange(first, first + n, dtype=torch.float32)[:, None].repeat(1, 3), \
        positions + 100, positions


def test_kept_rows_come_back_oldest_first_before_the_steps_own():
    store = DeferredIngest()
    hidden, next_ids, positions = _rows(0, 4)
    store.defer("a", hidden, next_ids, positions)
    hidden[:] = -1  # the step's buffer is reused: the store kept a copy
    store.defer("a", *_rows(4, 2))
    h, n, p = store.with_pending("a", *_rows(6, 1))
    assert p.tolist() == list(range(7)) and n.tolist() == [100 + i for i in range(7)]
    assert h[:, 0].tolist() == list(range(7))
    assert "a" not in store.pending  # taken once
    h, n, p = store.with_pending("a", *_rows(7, 1))
    assert p.tolist() == [7]
    assert (store.num_deferred, store.num_dropped) == (6, 0)


def test_rows_of_an_ended_request_are_dropped_and_counted():
    store = DeferredIngest()
    store.defer("b", *_rows(0, 3))
    store.forget("b")
    store.forget("never-seen")
    assert not store.pending and (store.num_deferred, store.num_dropped) == (3, 3)


def test_a_request_keeps_at_most_the_cap_back():
    store = DeferredIngest()
    assert store.has_room("c", MAX_DEFERRED_ROWS)
    store.defer("c", *_rows(0, MAX_DEFERRED_ROWS - 1))
    assert store.has_room("c", 1) and not store.has_room("c", 2)
