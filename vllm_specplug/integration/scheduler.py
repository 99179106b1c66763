"""Scheduler hook: size speculative slots per request from its draft lengths.

vLLM's sync `Scheduler` already schedules `1 + len(draft)` tokens per request,
because the drafts reach it (`update_draft_token_ids`) before the next step is
scheduled. Its `AsyncScheduler` schedules the next step *before* the drafts
exist, so it reserves `num_spec_tokens_to_schedule` placeholder slots for every
running request; a proposer that returns fewer tokens (n-gram without a match,
suffix with a short match) leaves `-1` slots that are computed and thrown away.

`SpecplugAsyncScheduler` keeps, per request, the length of the latest draft the
worker reported and reserves that many placeholders (at most the scheduler's
K). Lengths arrive through the two paths the engine core already has
(`update_draft_token_ids`, `update_draft_token_ids_in_output`) and through
`DRAFT_LENGTHS_ATTR` on a `ModelRunnerOutput` (a `{req_id: length}` dict a
worker may attach to the step output that carries its drafts). A misprediction
stays lossless: a longer draft is truncated to the reserved slots, a shorter one
is padded with -1 and counted as invalid, not as rejected (vLLM's own path).

Select it with `scheduler_cls="vllm_specplug.integration.scheduler.
SpecplugAsyncScheduler"`; it behaves as `AsyncScheduler` for everything else.
"""
from __future__ import annotations

import logging

import numpy as np
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.outputs import DraftTokenIds
from vllm.sampling_params import SamplingType
from vllm.v1.structured_output.utils import strip_speculative_padding

from vllm_specplug.integration.grammar_trees import (TREE_PARENTS_ATTR, chain_prefix_length,
                                                     fill_tree_rows, num_drafts_to_keep,
                                                     walk_tree)
from vllm_specplug.integration.worker_rows import WORKER, WORKER_ROWS_ATTR

# each constrained tree's way through a deferred step (DEBUG): the grammar GPU
# tests turn it on for the scheduler-rows engine, whose two unexplained
# failures came at one request and position (docs/results/v2_schema_choices_h200)
trace = logging.getLogger("vllm_specplug.grammar_trace")

DRAFT_LENGTHS_ATTR = "specplug_draft_lengths"
# on a V1 step's GrammarOutput: the greedy trees left unmasked (grammar_verify "choices")
CHOICE_TREES_ATTR = "specplug_choice_trees"
# AsyncScheduler marks a speculative slot whose draft token is not known yet
PLACEHOLDER_TOKEN_ID = -1


class SpecplugAsyncScheduler(AsyncScheduler):
    """`AsyncScheduler` whose placeholders follow each request's draft length."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # req_id -> length of the latest draft the worker made for it
        self.draft_length_hints: dict[str, int] = {}

    def record_draft_lengths(self, draft_lengths: dict[str, int]) -> None:
        for req_id, length in draft_lengths.items():
            if req_id in self.requests:
                self.draft_length_hints[req_id] = int(length)

    def _num_placeholders(self, req_id: str, num_spec_tokens: int) -> int:
        return min(self.draft_length_hints.get(req_id, num_spec_tokens),
                   num_spec_tokens)

    def schedule(self, *args, **kwargs):
        # Placeholders for step N+1 are set when step N is scheduled, but the
        # lengths of the drafts made during step N-1 only arrive (with its
        # output) just before step N+1 is scheduled: resize them here.
        for request in self.running:
            self._resize_placeholders(request)
        return super().schedule(*args, **kwargs)

    def _resize_placeholders(self, request) -> None:
        placeholders = request.spec_token_ids
        if not placeholders or placeholders[0] != PLACEHOLDER_TOKEN_ID:
            return                      # real drafts (sync path) or none
        num_slots = self._num_placeholders(request.request_id, len(placeholders))
        if num_slots != len(placeholders):
            request.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * num_slots

    def update_draft_token_ids(self, draft_token_ids) -> None:
        self.record_draft_lengths(_lengths_of(draft_token_ids))
        super().update_draft_token_ids(draft_token_ids)

    def update_draft_token_ids_in_output(self, draft_token_ids,
                                         scheduler_output) -> None:
        self.record_draft_lengths(_lengths_of(draft_token_ids))
        super().update_draft_token_ids_in_output(draft_token_ids, scheduler_output)

    def update_from_output(self, scheduler_output, model_runner_output):
        lengths = getattr(model_runner_output, DRAFT_LENGTHS_ATTR, None)
        if lengths:
            self.record_draft_lengths(lengths)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_request(self, request, *args, **kwargs):
        self.draft_length_hints.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


def _lengths_of(draft_token_ids) -> dict[str, int]:
    return {req_id: len(ids) for req_id, ids in
            zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)}


class TreeGrammarScheduler:
    """Mixin for a vLLM `Scheduler`: requests with structured output whose
    drafts came with tree parents are validated and masked per node
    (integration/grammar_trees.py); every other request goes through vLLM's code.
    Requests whose grammar starts after a reasoning section keep vLLM's chain
    rules, on the tree's chain prefix only."""

    def _grammar_trees(self) -> dict[str, list[int]]:
        """{req_id: parents (root included) of the drafts it was given}."""
        if not hasattr(self, "_specplug_grammar_trees"):
            self._specplug_grammar_trees = {}
        return self._specplug_grammar_trees

    def update_draft_token_ids(self, draft_token_ids) -> None:
        tree_parents = getattr(draft_token_ids, TREE_PARENTS_ATTR, None) or {}
        trees = self._grammar_trees()
        rest: tuple[list, list] = ([], [])
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            trees.pop(req_id, None)
            request, parents = self.requests.get(req_id), tree_parents.get(req_id)
            if (parents is None or request is None or request.is_finished()
                    or request.is_prefill_chunk or not request.use_structured_output):
                rest[0].append(req_id)
                rest[1].append(drafts)
                continue
            request.spec_token_ids = self._validate_tree(request, list(drafts), list(parents))
        for req_id in [r for r in trees if r not in self.requests]:
            del trees[req_id]
        super().update_draft_token_ids(DraftTokenIds(*rest))

    def _validate_tree(self, request, drafts: list[int], parents: list[int]) -> list[int]:
        manager = self.structured_output_manager
        if tuple(manager._get_constraint_bounds(request, drafts)) != (0, 0):
            return manager.validate_tokens(request, drafts[:chain_prefix_length(parents)])
        valid = walk_tree(request.structured_output_request.grammar, request.request_id,
                          drafts, parents, lambda node: None)
        keep = num_drafts_to_keep(valid)
        if keep:
            self._grammar_trees()[request.request_id] = parents[:keep + 1]
        return drafts[:keep]

    def get_grammar_bitmask(self, scheduler_output):
        spec = scheduler_output.scheduled_spec_decode_tokens
        trees = self._grammar_trees()
        ours = {req_id: trees[req_id][:len(spec[req_id]) + 1] for req_id in spec
                if req_id in trees and len(spec[req_id]) < len(trees[req_id])}
        chosen = self._choice_trees(ours)
        ours = {req_id: parents for req_id, parents in ours.items() if req_id not in chosen}
        if not (ours or chosen) or not scheduler_output.has_structured_output_requests:
            return super().get_grammar_bitmask(scheduler_output)
        # vLLM's rows for the other requests first, then each tree's rows,
        # filled here: workers map rows to requests by the id list, in any
        # order. (Handing the trees to vLLM too cost a fill per tree slot,
        # every one of them overwritten.) The chosen trees get none.
        req_ids = self._constrained_req_ids(scheduler_output, chosen)
        others = [req_id for req_id in req_ids if req_id not in ours]
        tree_ids = [req_id for req_id in req_ids if req_id in ours]
        manager = self.structured_output_manager
        if others:
            manager.grammar_bitmask(self.requests, others, spec)
        elif manager._grammar_bitmask is None:
            manager._grammar_bitmask = manager.backend.allocate_token_bitmask(
                self.vllm_config.scheduler_config.max_num_seqs
                * (1 + self.vllm_config.num_speculative_tokens))
        offset = sum(len(spec.get(req_id, ())) + 1 for req_id in others)
        end = self._fill_trees(tree_ids, ours, spec, offset)
        num_acceptable_drafts = (_vllm_num_acceptable(spec, others)
                                 + [len(spec[r]) for r in tree_ids])
        output = GrammarOutput(others + tree_ids, manager._grammar_bitmask[:end].numpy(),
                               num_acceptable_drafts)
        if chosen:
            setattr(output, CHOICE_TREES_ATTR, sorted(chosen))
        return output

    def _choice_trees(self, trees: dict) -> set[str]:
        """`grammar_verify: "choices"` on the V1 runner: the greedy requests
        among these trees, left unmasked; the worker's tree sampler decides
        their nodes from the target's choices (integration/v1/tree_choices.py).
        On Model Runner V2 the worker chooses them itself (worker_rows.py)."""
        if not hasattr(self, "_specplug_choices"):
            self._specplug_choices = choices_in_scheduler(self.vllm_config)
        if self._specplug_choices is None:
            return set()
        greedy = {req_id for req_id in trees
                  if self.requests[req_id].sampling_params.sampling_type == SamplingType.GREEDY}
        # "auto": too few trees this step, and the rows are cheaper
        return greedy if len(greedy) >= self._specplug_choices else set()

    def _constrained_req_ids(self, scheduler_output, leave_out=frozenset()) -> list[str]:
        """The step's requests that sample under a grammar (vLLM's
        `get_grammar_bitmask` list), but for `leave_out`."""
        return [req_id for req_id in scheduler_output.num_scheduled_tokens
                if req_id not in leave_out and (request := self.requests.get(req_id))
                is not None and request.use_structured_output
                and not request.is_prefill_chunk]

    def _fill_trees(self, tree_ids: list[str], ours: dict, spec: dict, offset: int) -> int:
        """Fill each tree's rows from `offset` on, one tree after the other in
        the bitmask; returns the end. (On threads, the walks of a 32-tree step
        took 2.5x longer on this 2-core CPU under load: benchmarks/
        bench_grammar_walk.py `--workers` measures it on a GPU host.)"""
        manager = self.structured_output_manager
        rows = manager._grammar_bitmask
        for req_id in tree_ids:
            grammar = self.requests[req_id].structured_output_request.grammar
            num_rows = len(ours[req_id])
            valid = fill_tree_rows(grammar, req_id, spec[req_id], ours[req_id],
                                   rows[offset:offset + num_rows],
                                   lambda node, base=offset, grammar=grammar:
                                   manager._fill_bitmasks(((grammar, base + node, True),)))
            if trace.isEnabledFor(logging.DEBUG):  # no list built on the step's path otherwise
                trace.debug("tree rows: %s valid=%s", req_id, [int(v) for v in valid])
            offset += num_rows
        return offset


class SpecplugTreeScheduler(TreeGrammarScheduler, Scheduler):
    """vLLM's sync `Scheduler` with grammar-aware draft trees
    (integration/grammar_trees.py); our tree methods get it on the V1
    runner unless the user names a scheduler."""


class SpecplugTreeAsyncScheduler(TreeGrammarScheduler, AsyncScheduler):
    """vLLM's `AsyncScheduler` with grammar-aware draft trees; our tree
    methods get it on Model Runner V2 unless the user names a scheduler.

    Under async scheduling a step is scheduled before its drafts exist: its
    slots are placeholders, and for requests with structured output the
    engine core defers the step's bitmask until the drafts arrive
    (`update_draft_token_ids_in_output`). A tree's nodes then keep their
    slots, all of them (the slots are computed anyway): an invalid node gets
    its parent's row, which forbids its token, so it is never accepted, and
    every other node the row of its own path (`get_grammar_bitmask`). The
    tree sampler on V2 walks trees over those rows
    (integration/v2/tree_sampler.py). Requests whose grammar starts after a
    reasoning section go through vLLM's code on the tree's chain prefix."""

    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output) -> None:
        tree_parents = getattr(draft_token_ids, TREE_PARENTS_ATTR, None) or {}
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        trees = self._grammar_trees()
        rest: tuple[list, list] = ([], [])
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            trees.pop(req_id, None)
            request, parents = self.requests.get(req_id), tree_parents.get(req_id)
            num_slots = len(scheduled.get(req_id) or ())
            drafts = list(drafts[:num_slots])
            if (parents is None or not num_slots or request is None or request.is_finished()
                    or request.is_prefill_chunk or not request.use_structured_output):
                rest[0].append(req_id)
                rest[1].append(drafts)
            elif tuple(self.structured_output_manager._get_constraint_bounds(
                    request, drafts)) != (0, 0):
                # vLLM's chain rules on the chain prefix: it pads the slots past
                # what it keeps with -1, invalid to the worker (`num_acceptable_drafts`)
                rest[0].append(req_id)
                rest[1].append(drafts[:chain_prefix_length(parents)])
            else:
                trees[req_id] = list(parents[:num_slots + 1])
                scheduled[req_id] = drafts
            if trace.isEnabledFor(logging.DEBUG) and request is not None \
                    and request.use_structured_output:
                _trace_draft(request, req_id in trees, num_slots, drafts, parents)
        super().update_draft_token_ids_in_output(DraftTokenIds(*rest), scheduler_output)

    def _update_after_schedule(self, scheduler_output) -> None:
        """With the rows in the worker (integration/worker_rows.py), a step
        whose constrained requests have tokens in flight is not deferred:
        those requests are named for the worker, which fills their rows."""
        super()._update_after_schedule(scheduler_output)
        if not self._rows_in_worker():
            return
        spec = scheduler_output.scheduled_spec_decode_tokens
        in_flight = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if not request.use_structured_output or request.is_prefill_chunk:
                continue
            # vLLM's test, before this step's own placeholders were added
            added = self.num_sampled_tokens_per_step + len(spec.get(req_id, ()))
            if request.num_output_placeholders > added:
                in_flight.append(req_id)
        setattr(scheduler_output, WORKER_ROWS_ATTR, in_flight)
        scheduler_output.pending_structured_output_tokens = False

    def _rows_in_worker(self) -> bool:
        if not hasattr(self, "_specplug_rows_in_worker"):
            self._specplug_rows_in_worker = rows_in_worker(self.vllm_config)
        return self._specplug_rows_in_worker

    def get_grammar_bitmask(self, scheduler_output):
        # The trees serve the deferred step they came with, only: a later
        # bitmask built before its drafts arrive (placeholder slots, which
        # vLLM leaves unacceptable) must not read a stale tree.
        try:
            if trace.isEnabledFor(logging.DEBUG):
                self._trace_step(scheduler_output)
            in_worker = getattr(scheduler_output, WORKER_ROWS_ATTR, None)
            if in_worker:
                return self._rows_of_others(scheduler_output, set(in_worker))
            return super().get_grammar_bitmask(scheduler_output)
        finally:
            self._grammar_trees().clear()

    def update_from_output(self, scheduler_output, model_runner_output):
        if trace.isEnabledFor(logging.DEBUG):
            sampled_ids = model_runner_output.sampled_token_ids
            for req_id, sampled in zip(model_runner_output.req_ids,
                                       () if sampled_ids is None else sampled_ids):
                request = self.requests.get(req_id)
                if request is not None and request.use_structured_output:
                    trace.debug("sampled: %s outputs=%d tokens=%s", req_id,
                                request.num_output_tokens, list(sampled))
        return super().update_from_output(scheduler_output, model_runner_output)

    def _trace_step(self, scheduler_output) -> None:
        spec, trees = scheduler_output.scheduled_spec_decode_tokens, self._grammar_trees()
        for req_id in self._constrained_req_ids(scheduler_output):
            request = self.requests[req_id]
            trace.debug("bitmask: %s outputs=%d placeholders=%d deferred=%s tree=%s spec=%s",
                        req_id, request.num_output_tokens, request.num_output_placeholders,
                        scheduler_output.pending_structured_output_tokens, req_id in trees,
                        list(spec.get(req_id, ())))

    def _rows_of_others(self, scheduler_output, in_worker: set[str]):
        """vLLM's `get_grammar_bitmask` for the requests the worker does not
        fill (None: none left)."""
        req_ids = self._constrained_req_ids(scheduler_output, in_worker)
        if not req_ids:
            return None
        spec = scheduler_output.scheduled_spec_decode_tokens
        bitmask = self.structured_output_manager.grammar_bitmask(self.requests, req_ids, spec)
        return GrammarOutput(req_ids, bitmask, _vllm_num_acceptable(spec, req_ids))


def _trace_draft(request, as_tree: bool, num_slots: int, drafts: list[int],
                 parents: list[int] | None) -> None:
    trace.debug("deferred step: %s outputs=%d placeholders=%d %s slots=%d drafts=%s "
                "parents=%s", request.request_id, request.num_output_tokens,
                request.num_output_placeholders, "tree" if as_tree else "vllm-chain",
                num_slots, list(drafts), None if parents is None else list(parents))


def _vllm_num_acceptable(spec: dict, req_ids: list[str]) -> list[int]:
    """vLLM's `num_acceptable_drafts` for requests it filled as chains: the
    drafts before the first -1 placeholder."""
    return [len(strip_speculative_padding(spec.get(req_id, []))) for req_id in req_ids]


def masks_rows_per_node(scheduler_config) -> bool:
    """Whether the engine's scheduler checks and masks each tree node on its
    own path: a `TreeGrammarScheduler`, and under async scheduling one with
    the deferred step's part too (`SpecplugTreeAsyncScheduler`): a
    `TreeGrammarScheduler` on vLLM's `AsyncScheduler` alone reads a
    constrained tree as a list there. Without it, trees under structured
    outputs verify what vLLM's chain rules allow."""
    base = (SpecplugTreeAsyncScheduler if scheduler_config.async_scheduling
            else TreeGrammarScheduler)
    return issubclass(scheduler_config.get_scheduler_cls(), base)


def rows_in_worker(vllm_config) -> bool:
    """Whether the worker fills constrained steps' verification rows
    (integration/worker_rows.py): our tree methods with `grammar_rows:
    "worker"` on Model Runner V2 under async scheduling, with
    a scheduler that hands the rows over (`SpecplugTreeAsyncScheduler`), and
    no reasoning parser (a grammar that starts after a reasoning section
    keeps vLLM's chain rules)."""
    from vllm_specplug.integration.config import selection_of
    from vllm_specplug.registry import get_proposer_class

    spec = getattr(vllm_config, "speculative_config", None)
    selection = selection_of(spec) if spec is not None else None
    scheduler = vllm_config.scheduler_config
    structured = vllm_config.structured_outputs_config
    if (selection is None or not scheduler.async_scheduling
            or not getattr(vllm_config, "use_v2_model_runner", False)
            or structured.reasoning_parser or structured.reasoning_parser_plugin):
        return False
    options = get_proposer_class(selection.method).options_cls(**selection.options)
    return (getattr(options, "grammar_rows", None) == WORKER
            and issubclass(scheduler.get_scheduler_cls(), SpecplugTreeAsyncScheduler))


def choices_in_scheduler(vllm_config) -> int | None:
    """The fewest greedy trees a step that the scheduler leaves unmasked for
    the worker's choices on the V1 runner (`TreeOptions.choices_min_trees`:
    1 with `grammar_verify: "choices"`, more with "auto"); None: never."""
    from vllm_specplug.integration.config import selection_of
    from vllm_specplug.registry import get_proposer_class

    spec = getattr(vllm_config, "speculative_config", None)
    selection = selection_of(spec) if spec is not None else None
    if selection is None or getattr(vllm_config, "use_v2_model_runner", False):
        return None
    options = get_proposer_class(selection.method).options_cls(**selection.options)
    min_trees = getattr(options, "choices_min_trees", None)
    return min_trees() if min_trees is not None else None


def merged_grammar_output(scheduler_rows, req_ids: list[str], bitmask: np.ndarray,
                          num_acceptable: list[int]):
    """The scheduler's `GrammarOutput` (None: it filled no row) with the
    worker's requests and rows after its own (the worker maps rows to
    requests by the id list, in any order)."""
    if scheduler_rows is None:
        return GrammarOutput(req_ids, bitmask, num_acceptable)
    theirs = scheduler_rows.num_acceptable_drafts
    if theirs is None:  # an older scheduler's: none of its drafts acceptable
        theirs = [0] * len(scheduler_rows.structured_output_request_ids)
    return GrammarOutput(list(scheduler_rows.structured_output_request_ids) + req_ids,
                         np.concatenate([scheduler_rows.grammar_bitmask, bitmask]),
                         list(theirs) + num_acceptable)
