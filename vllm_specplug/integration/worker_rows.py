"""A constrained step's verification rows, filled in the worker
(`grammar_rows: "worker"`, the default of our tree methods on Model Runner
V2 under async scheduling; exact on the H200, 1.13x vLLM's deferred step
at batch 16 and 64 on SmolLM2 under a JSON schema:
docs/results/v2_worker_rows_h200_run2).

Under async scheduling vLLM's engine core defers the bitmask of a step in
which a request with structured output still has tokens in flight
(`AsyncScheduler` sets `pending_structured_output_tokens`): it waits for the
previous step's output, takes the drafts from the worker (an RPC),
validates them, fills one row per verified position and only then lets the
worker sample (`EngineCore.step_with_batch_queue`). Every constrained step's
sampling waits on that round trip: on SmolLM2 under a JSON schema (H200)
vLLM's `eagle3` ran at 0.66-0.70x of no speculation, against 1.05-1.10x
without the schema, with the same tokens a step
(docs/results/v2_grammar_first_smollm2_h200).

Here the scheduler (`SpecplugTreeAsyncScheduler`, where
`scheduler.rows_in_worker` holds) defers nothing for those requests and
names them on the scheduler output (`WORKER_ROWS_ATTR`). The
worker fills their rows before it samples, while the step's forward runs:
it has the drafts (copied to the host on a side stream after the drafting
pass: vLLM's `DraftTokensHandler`, our `GrammarParents` for trees) and its
own grammar per request (`StructuredRequests`, advanced to each step's
output when the drafting pass reads it for the root masks, or from a copy
of the outputs that pass queued without waiting when it masks nothing:
`StructuredRequests.queue_outputs`). Each tree node,
or chain position, gets the row of its own path's grammar state, an invalid
node its nearest valid ancestor's row, which forbids it (grammar_trees.py:
the scheduler's own fill, the same code): exact, as the scheduler's rows
are. The scheduler still fills the rows of requests it knows in full (no
tokens in flight: a prefill's last chunk, a request back from preemption),
and its grammar still advances with every output (stop, checks). The
worker's rows follow the scheduler's in the step's `GrammarOutput`
(`scheduler.merged_grammar_output`; the glue on Model Runner V2:
`HeadGrammar.verification_rows`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from vllm_specplug.integration.grammar_trees import NativeWalk, fill_tree_rows, native_walk
from vllm_specplug.proposers.eagle3 import chain_parents

# on a SchedulerOutput: [req_id] of the requests whose rows the worker fills
WORKER_ROWS_ATTR = "specplug_worker_rows"
WORKER = "worker"


def fill_request_rows(grammar, req_id: str, rows: torch.Tensor,
                      draft_token_ids: Sequence[int] | None,
                      parents: Sequence[int] | None, max_drafts: int | None = None) -> int:
    """One request's rows ([1 + num_slots, words] int32, a view of the step's
    bitmask): every node's in its own path's state (`parents` None: a
    chain). Returns how many of its drafts may be accepted: all its slots,
    since an invalid node's row forbids it, or 0 where its drafts are not
    known here (missing, too few, or vLLM's -1 placeholders: each slot then
    gets the root's row, and vLLM's sampler accepts none of them,
    `num_acceptable_drafts`; rows built from placeholders would let the
    device's real drafts through on the wrong path's rows). A chain
    (`RowDepth`) or a tree (`grammar_tree_rows`) with `max_drafts` gets rows
    for its first `max_drafts` drafts only, the rest a copy of the last,
    and only those drafts acceptable (a tree's parents come before their
    children: its first drafts are a subtree)."""
    walk, finish = plan_request_rows(grammar, req_id, rows, draft_token_ids, parents,
                                     max_drafts)
    if walk is not None:
        walk.run()
    return finish()


def plan_request_rows(grammar, req_id: str, rows: torch.Tensor,
                      draft_token_ids: Sequence[int] | None, parents: Sequence[int] | None,
                      max_drafts: int | None = None) -> tuple[NativeWalk | None,
                                                               Callable[[], int]]:
    """`fill_request_rows` in two parts: (xgrammar's walk of the request's
    tree, which any thread may run, or None) and the rest, to call after it
    on this thread, which returns the acceptable drafts (row_threads.py)."""
    num_slots = rows.shape[0] - 1
    fill = _row_filler(grammar, rows)
    known = draft_token_ids is not None and len(draft_token_ids) >= num_slots and (
        not num_slots or min(draft_token_ids[:num_slots]) >= 0)  # -1: vLLM's "unknown"
    if num_slots and not known:
        fill(0)
        rows[1:] = rows[0]
        return None, lambda: 0
    if max_drafts is not None and max_drafts < num_slots:  # a node's parent comes first:
        # the first max_drafts drafts of a tree are a subtree
        walk, finish_prefix = plan_request_rows(
            grammar, req_id, rows[:max_drafts + 1], list(draft_token_ids)[:max_drafts],
            None if parents is None else list(parents)[:max_drafts + 1])

        def finish_depth() -> int:
            num_acceptable = finish_prefix()
            rows[max_drafts + 1:] = rows[max_drafts]  # never sampled from: not acceptable
            return num_acceptable
        return walk, finish_depth
    parents = (chain_parents(num_slots + 1).tolist() if parents is None
               else list(parents[:num_slots + 1]))
    drafts = list(draft_token_ids or ())[:num_slots]
    walk = native_walk(grammar, drafts, parents, rows)
    if walk is not None:
        return walk, lambda: (walk.finish(), num_slots)[1]
    return None, lambda: (fill_tree_rows(grammar, req_id, drafts, parents, rows, fill),
                          num_slots)[1]


def num_grammar_rows(input_batch, row: int) -> int:
    """The bitmask rows Model Runner V2 maps to request `row` of its input
    batch (`_build_grammar_mapping`: its scheduled drafts and the bonus
    token, or its logits rows)."""
    num_drafts = input_batch.num_draft_tokens_per_req
    if num_drafts is not None:
        return int(num_drafts[row]) + 1
    cu_num_logits = input_batch.cu_num_logits_np
    return int(cu_num_logits[row + 1] - cu_num_logits[row])


def _row_filler(grammar, rows: torch.Tensor):
    """vLLM's fill of one row (`StructuredOutputManager._fill_bitmasks`): the
    grammar's bitmask in its current state, every bit once it terminated."""
    def fill(node: int) -> None:
        if grammar.is_terminated():
            rows[node].fill_(-1)
        else:
            grammar.fill_bitmask(rows, node)
    return fill


# `RowDepth`: a chain's rows are filled for draft j while at least this share
# of chains reach it (drafts 1..j all accepted): each position past the depth
# costs at most that share of a token a request-step
MIN_REACH = 0.01
MIN_OBSERVED = 64.0  # chains with a row for draft j before its share is trusted
PROBE_EVERY = 16     # one step in this many fills every row: deeper shares stay known
KEEP = 1.0 - 1.0 / 1000  # each position's share is over its last ~1000 chains


class RowDepth:
    """How many drafts of a chain get verification rows in the worker
    (`grammar_row_depth: "auto"`). Draft j's row is its chain's grammar
    state after drafts 1..j, and a row is only sampled from when every
    draft before it was accepted; on SmolLM2 under a JSON schema (H200)
    0.09-0.17 of the chains reached draft 1 and 0.00-0.01 draft 2, while
    filling the 6 rows of a K=5 chain cost the worker 2.0 ms a step at
    batch 16 and 5.2 ms at 64, half the step
    (docs/results/v2_queued_rows_h200). Rows past the depth are not filled
    and their drafts not acceptable (`num_acceptable_drafts`): output is
    unchanged (a draft not acceptable is a draft rejected), and each
    position left out costs at most the share of chains that reach it
    (under MIN_REACH) of a token a request-step.

    The shares come from the worker's own grammars: a request's output
    grows by its accepted drafts plus one between two steps' rows."""

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.offered = np.zeros(max_drafts + 1)  # [K + 1] float64: chains with a row for draft j
        self.reached = np.zeros(max_drafts + 1)  # [K + 1] float64: of which drafts 1..j accepted
        # (both fading: each observation of a position weighs the older ones by KEEP)
        # req_id -> (output length, acceptable drafts) at its rows of the last step / this one
        self.last: dict[str, tuple[int, int]] = {}
        self.this: dict[str, tuple[int, int]] = {}
        self.num_steps = 0

    def begin_step(self) -> int:
        """This step's depth: every draft on a probe step, or while a
        share is not yet known."""
        self.num_steps += 1
        self.last, self.this = self.this, {}
        if self.num_steps % PROBE_EVERY == 0:
            return self.max_drafts
        for j in range(1, self.max_drafts + 1):
            if self.offered[j] < MIN_OBSERVED:
                return self.max_drafts
            if self.reached[j] < MIN_REACH * self.offered[j]:
                return j - 1
        return self.max_drafts

    def observe(self, req_id: str, output_len: int) -> None:
        """`req_id`'s output length before this step's rows: what the
        drafts of its last rows became."""
        last = self.last.get(req_id)
        if last is None:
            return
        num_accepted, num_acceptable = output_len - last[0] - 1, last[1]
        if not 0 <= num_accepted <= num_acceptable:  # not a verify step of those rows
            return
        rows = slice(1, num_acceptable + 1)  # per observation, not per step: a
        # deeper position, seen on probe steps only, keeps its share as long
        self.offered[rows] = self.offered[rows] * KEEP + 1.0
        self.reached[rows] = self.reached[rows] * KEEP + (
            np.arange(1, num_acceptable + 1) <= num_accepted)

    def filled(self, req_id: str, output_len: int, num_acceptable: int) -> None:
        if num_acceptable > 0:
            self.this[req_id] = (output_len, num_acceptable)
