"""A step's chain rows at once: our chain's verification rows in the worker
(`grammar_rows: "worker"`, `integration/worker_rows.py`), filled depth by
depth over every request with xgrammar's batch calls.

Row j of a chain is its grammar's bitmask after drafts 1..j; an invalid
draft gets its parent's row (which forbids it) and so does every draft
after it; a draft that ends the grammar (an accepted stop token) gets
vLLM's full row for a terminated grammar, and so does every one after it.
`plan_request_rows` walks one chain at a time (`GrammarMatcher.
traverse_draft_tree`, then its bookkeeping in Python): on SmolLM2 under a
JSON schema at batch 64 the worker spent 6.2-7.0 ms a step on its grammar
(H100, docs/results/smollm2_schema_queued_h100_s71), about 100 µs a
request, and `benchmarks/bench_v2_grammar_step.py --chain 5` put the same
work at 5.5-5.7 ms on this CPU, nearly half of it Python around the C++
walks. Here a step makes one `batch_fill_next_token_bitmask` (on
xgrammar's own threads) and one `batch_accept_token` a depth, one
`batch_rollback` at the end, and its bookkeeping in NumPy over the step.

The rows are the ones `plan_request_rows` fills, bit for bit, with the same
acceptable drafts (tests/test_chain_rows.py compares them on random chains
under a JSON schema); requests it cannot take (another backend, a grammar
already ended, drafts not known or outside the rows' vocabulary) go through
`fill_request_rows` as before.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_specplug.integration.worker_rows import fill_request_rows


class ChainRows:
    """The batch matcher of a speculator's chains (xgrammar's thread pool,
    `num_threads` of them: `grammar_row_threads`)."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._batch = None  # xgrammar.BatchGrammarMatcher, made at the first batched step
        self.num_batched = 0  # requests whose rows the batched walk filled (tests, stats)

    def fill(self, req_ids: Sequence[str], grammars: dict, drafts: dict,
             num_rows: Sequence[int], bitmask: torch.Tensor,
             max_drafts: int | None) -> list[int]:
        """Each request's rows (`num_rows[i]` of `bitmask` [sum, words]
        int32, in order) and its acceptable drafts, as `fill_request_rows`
        with no parents (a chain) and `max_drafts` (`RowDepth`; None:
        every draft)."""
        offsets = np.cumsum([0, *num_rows])
        num_acceptable = [0] * len(req_ids)
        batched = []
        for i, req_id in enumerate(req_ids):
            grammar, tokens = grammars[req_id], drafts.get(req_id)
            depth = _batched_depth(grammar, tokens, num_rows[i] - 1, max_drafts,
                                   bitmask.shape[1] * 32)
            if depth is None:
                num_acceptable[i] = fill_request_rows(
                    grammar, req_id, bitmask[offsets[i]:offsets[i + 1]], tokens, None,
                    max_drafts)
                continue
            batched.append((i, grammar.matcher, list(tokens[:depth]), depth))
            num_acceptable[i] = depth
        if batched:
            self._walk(batched, offsets, bitmask)
            self.num_batched += len(batched)
        return num_acceptable

    def _walk(self, chains: list[tuple[int, object, list[int], int]], offsets: np.ndarray,
              bitmask: torch.Tensor) -> None:
        """Rows 0..depth of each (request, matcher, drafts, depth), depth by
        depth; then each request's rows past its last filled one copy it."""
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(self.num_threads)
        words = bitmask.numpy()  # a view
        starts = np.array([offsets[i] for i, *_ in chains])
        last = np.zeros(len(chains), dtype=np.int64)  # each one's last row filled, from its start
        num_advanced = np.zeros(len(chains), dtype=np.int64)
        alive = np.arange(len(chains))
        j = 0
        while len(alive):
            rows = (starts[alive] + j).tolist()
            self._batch.batch_fill_next_token_bitmask([chains[c][1] for c in alive], bitmask, rows)
            last[alive] = j
            alive = alive[[j < chains[c][3] for c in alive]]  # a draft after this row
            if not len(alive):
                break
            tokens = np.array([chains[c][2][j] for c in alive], dtype=np.int64)
            row_words = words[starts[alive] + j, tokens >> 5].view(np.uint32)
            allowed = alive[((row_words >> (tokens & 31).astype(np.uint32)) & 1) == 1]
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(
                [chains[c][1] for c in allowed], [chains[c][2][j] for c in allowed])
            allowed = allowed[np.asarray(accepted, dtype=bool)] if len(allowed) else allowed
            num_advanced[allowed] += 1
            ended = np.array([chains[c][1].is_terminated() for c in allowed], dtype=bool)
            if ended.any():  # vLLM's full row for a grammar its draft ended
                done = allowed[ended]
                words[starts[done] + j + 1] = -1
                last[done] = j + 1
            alive = allowed[~ended] if len(allowed) else allowed
            j += 1
        for c, (i, *_) in enumerate(chains):
            end = offsets[i + 1]
            if starts[c] + last[c] + 1 < end:  # invalid drafts, ended grammars, past the depth
                words[starts[c] + last[c] + 1:end] = words[starts[c] + last[c]]
        rolled = np.flatnonzero(num_advanced)
        if len(rolled):
            xgr.BatchGrammarMatcher.batch_rollback([chains[c][1] for c in rolled],
                                                   num_advanced[rolled].tolist())


def _batched_depth(grammar, draft_token_ids, num_slots: int, max_drafts: int | None,
                   num_bits: int) -> int | None:
    """How many of a request's drafts the batched walk takes (its rows
    0..depth), or None where `fill_request_rows` must fill them: not an
    xgrammar matcher, its grammar ended, its drafts not all known (vLLM's
    -1 placeholders, too few: its rows are then the root's, none
    acceptable) or one of the walked drafts outside the rows' bits."""
    import xgrammar as xgr

    if not isinstance(getattr(grammar, "matcher", None), xgr.GrammarMatcher):
        return None
    if grammar.is_terminated() or not num_slots:
        return None
    if (draft_token_ids is None or len(draft_token_ids) < num_slots
            or min(draft_token_ids[:num_slots]) < 0):
        return None
    depth = num_slots if max_drafts is None else min(max_drafts, num_slots)
    if depth and max(draft_token_ids[:depth]) >= num_bits:
        return None
    return depth
