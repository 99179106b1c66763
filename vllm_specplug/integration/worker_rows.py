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

from collections.abc import Sequence

import torch

from vllm_specplug.integration.grammar_trees import fill_tree_rows
from vllm_specplug.proposers.eagle3 import chain_parents

# on a SchedulerOutput: [req_id] of the requests whose rows the worker fills
WORKER_ROWS_ATTR = "specplug_worker_rows"
WORKER = "worker"


def fill_request_rows(grammar, req_id: str, rows: torch.Tensor,
                      draft_token_ids: Sequence[int] | None,
                      parents: Sequence[int] | None) -> int:
    """One request's rows ([1 + num_slots, words] int32, a view of the step's
    bitmask): every node's in its own path's state (`parents` None: a
    chain). Returns how many of its drafts may be accepted: all its slots,
    since an invalid node's row forbids it, or 0 where its drafts are not
    known here (missing, too few, or vLLM's -1 placeholders: each slot then
    gets the root's row, and vLLM's sampler accepts none of them,
    `num_acceptable_drafts`; rows built from placeholders would let the
    device's real drafts through on the wrong path's rows)."""
    num_slots = rows.shape[0] - 1
    fill = _row_filler(grammar, rows)
    known = draft_token_ids is not None and len(draft_token_ids) >= num_slots and all(
        int(token) >= 0 for token in draft_token_ids[:num_slots])  # -1: vLLM's "unknown"
    if num_slots and not known:
        fill(0)
        rows[1:] = rows[0]
        return 0
    parents = (chain_parents(num_slots + 1).tolist() if parents is None
               else list(parents[:num_slots + 1]))
    fill_tree_rows(grammar, req_id, list(draft_token_ids or ())[:num_slots], parents, rows,
                   fill)
    return num_slots


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
