"""Structured-output requests as the EAGLE-3/MTP head's V2 speculator
(`SpecplugV2HeadSpeculator`) meets them: the drafting pass's grammar masks
(every step, eagerly: `StructuredRequests.path_masks`; the first step only,
inside the graphs: `RootMasks`), and the parents of trees drafted for such
a batch, for the scheduler's per-node checks (`GrammarParents`)."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_specplug.integration.grammar_choices import GrammarChoices
from vllm_specplug.integration.grammar_trees import TREE_PARENTS_ATTR
from vllm_specplug.integration.row_threads import RowThreads, num_row_threads
from vllm_specplug.integration.ranges import profiled_range
from vllm_specplug.integration.scheduler import merged_grammar_output, rows_in_worker
from vllm_specplug.integration.tree_walks import TreeWalks, plan_tree_walks
from vllm_specplug.integration.v2.structured import StructuredRequests
from vllm_specplug.integration.worker_rows import (WORKER, RowDepth, num_grammar_rows,
                                                   plan_request_rows)
from vllm_specplug.proposers.eagle3 import AUTO_ROW_DEPTH, FULL_TREE_ROWS, SCHEDULER_ROWS
from vllm_specplug.proposers.head_graphs import padded_batch

logger = logging.getLogger("vllm_specplug.tree_drafter")


class HeadGrammar:
    """Mixin of `SpecplugV2HeadSpeculator`: reads its runtime, guard,
    structured requests, root masks, grammar parents and tree slots."""

    def _init_grammar(self, vllm_config, options) -> None:
        """Structured requests' grammars: each drafting step of theirs ranks
        only what its node's path allows (structured.py), and with
        grammar_rows "worker" a constrained step's verification rows filled
        here from those grammars, not in a deferred step (worker_rows.py)."""
        self.rows_in_worker = rows_in_worker(vllm_config)
        if self.tree_slots is not None and options.grammar_rows == SCHEDULER_ROWS:
            logger.warning("vllm-specplug: grammar_rows=%r with trees on Model Runner V2 "
                           "differed from no speculation in 2 of 5 float32 test runs "
                           "(docs/results/v2_schema_choices_h200); the default %r has "
                           "not", SCHEDULER_ROWS, WORKER)
        self.worker_rows_req_ids: list[str] = []  # this step's (the scheduler's list)
        self.structured = (StructuredRequests(vllm_config)
                           if options.masks_drafts() or self.rows_in_worker else None)
        # those rows' tree walks on host threads (grammar_row_threads)
        self.row_threads = RowThreads(num_row_threads(options.grammar_row_threads)
                                      if self.rows_in_worker else 1)
        # a chain's worker rows only as deep as its drafts get accepted
        self.row_depth = (RowDepth(vllm_config.speculative_config.num_speculative_tokens)
                          if self.rows_in_worker and self.tree_slots is None
                          and options.grammar_row_depth == AUTO_ROW_DEPTH else None)
        # a tree's rows for its first drafts only (grammar_tree_rows; None: every node)
        self.tree_rows = (options.grammar_tree_rows if self.rows_in_worker
                          and self.tree_slots is not None
                          and options.grammar_tree_rows != FULL_TREE_ROWS else None)
        # greedy batches' constrained trees decided from the target's
        # choices, not every node's row (grammar_verify "choices"; "auto":
        # on steps with at least `choices_min_trees` such trees)
        options.check_model_runner_v2()  # "auto" is refused here for now
        self.choices_min_trees = options.choices_min_trees()
        self.grammar_choices = (self.choices_for(self.structured) if self.rows_in_worker
                                and self.tree_slots is not None
                                and self.choices_min_trees is not None else None)
        self.stats.grammar_choices = self.grammar_choices
        self.stats.draft_grammars = (self.structured.grammars if self.grammar_choices is not None
                                     else None)
        # grammar_drafts "first": the first step's masks inside the graphed
        # pass (root_masks.py), made at attach (they need the head's vocabulary)
        self.root_masks = None

    @staticmethod
    def choices_for(structured) -> GrammarChoices:
        """The greedy walks of `grammar_verify: "choices"` over `structured`'s
        grammars, each walk's advances kept for the drafting pass."""
        return GrammarChoices(keep=structured.keep_walked)

    def _attach_root_masks(self) -> None:
        """The first step's masks, read by every drafting pass (graphs too)."""
        from vllm_specplug.integration.v2.root_masks import RootMasks

        layer = self.runtime.layer
        draft_to_target = layer.to_target(torch.arange(layer.logits_size, device=self.device))
        self.root_masks = RootMasks(padded_batch(self.max_num_reqs),
                                    self.vllm_config.model_config.get_vocab_size(),
                                    draft_to_target)
        self.runtime.first_logits_mask = self.root_masks

    def _grammar_masks(self, input_batch):
        """The drafting pass's logits hook when the batch has structured
        output (`StructuredRequests.path_masks`): its steps then run apart
        and eagerly, the hook reading the pass on the host. With first-step
        masks (`root_masks`) the rows are loaded instead, and the pass stays
        graphed (None). A grammar's fault costs the step its masks, never
        the engine."""
        structured = (self.structured is not None and bool(self.structured)
                      and input_batch.has_structured_output_reqs)
        if not self.drafter.options.masks_drafts():
            self.queue_for_rows(input_batch)
            return None
        if self.root_masks is not None:
            if structured or self.root_masks.num_masked_rows:
                self._load_root_masks(input_batch, structured)
            return None
        if not structured:
            return None
        ok, masks = self.guard.call("grammar_masks", input_batch.req_ids,
                                    self.structured.path_masks, input_batch, self.req_states,
                                    self.runtime.layer, self.device,
                                    effect="its drafts go unmasked this step")
        return masks if ok else None

    def queue_for_rows(self, input_batch) -> None:
        """With the rows in the worker, a drafting pass that reads no output
        (unmasked, or a step without drafts) queues their copy for the next
        step's rows (`StructuredRequests.queue_outputs`)."""
        if (self.rows_in_worker and self.structured is not None and bool(self.structured)
                and input_batch.has_structured_output_reqs):
            self.structured.queue_outputs(input_batch, self.req_states)

    def _load_root_masks(self, input_batch, structured: bool) -> None:
        """The first step's rows of this batch (`RootMasks.load`); all
        allowed where no request has a grammar, or its fill failed."""
        if not structured:
            return self.root_masks.clear()
        # the tokens this step's greedy trees emitted, as `grammar_verify:
        # "choices"` decided them on the host: no read of those outputs
        known = self.grammar_choices.take_emitted() if self.grammar_choices is not None else None
        with profiled_range("specplug::root_masks"):
            ok, bitmask = self.guard.call("grammar_masks", input_batch.req_ids,
                                          self.structured.root_bitmask, input_batch,
                                          self.req_states, known,
                                          effect="its drafts go unmasked this step")
            self.root_masks.load(bitmask if ok else None)

    def _keep_parents_for_grammar(self, input_batch) -> None:
        """With structured output in the batch, the scheduler checks each
        node of these trees in its own path's grammar state: their parents
        go to the host beside vLLM's copy of the drafts (grammar_parents.py)."""
        if not input_batch.has_structured_output_reqs:
            self.grammar_parents.clear()
            return
        num_reqs = input_batch.num_reqs
        self.grammar_parents.record(input_batch.req_ids[:num_reqs], self.tree_slots.parents[
            input_batch.idx_mapping[:num_reqs]])

    def take_tree_parents(self) -> dict[str, list[int]]:
        """{req_id: parents, root included} of the trees last drafted for a
        batch with structured output (`take_draft_token_ids`); {} otherwise."""
        return self.grammar_parents.take() if self.grammar_parents is not None else {}

    def verification_rows(self, runner, grammar_output):
        """Before Model Runner V2 samples (our runner patch calls it): the
        scheduler's `GrammarOutput` with the rows of the requests it left to
        the worker (worker_rows.py), each filled from the request's grammar
        and the drafts this step verifies."""
        req_ids, self.worker_rows_req_ids = self.worker_rows_req_ids, []
        if self.grammar_choices is not None:
            self.grammar_choices.forget()  # a plan lives for its own step's sampling only
        state = runner.execute_model_state
        if not req_ids or state is None:
            return grammar_output
        with profiled_range("specplug::worker_rows"):  # a range of `bench offline --phases`
            return self._verification_rows(runner, state.input_batch, req_ids, grammar_output)

    def _verification_rows(self, runner, input_batch, req_ids: list[str], grammar_output):
        started = time.perf_counter()
        taken = runner.take_draft_token_ids()  # vLLM's host copy, trees' parents beside
        drafts = {} if taken is None else dict(zip(taken.req_ids, taken.draft_token_ids))
        parents = getattr(taken, TREE_PARENTS_ATTR, None) or {}
        num_reads = self.structured.num_device_reads
        grammars = self.structured.verifying_grammars(req_ids, input_batch, self.req_states)
        ids = [req_id for req_id in req_ids if req_id in grammars]
        if self.tree_slots is not None:  # a tree's drafts without its parents are unknown
            drafts = {req_id: d for req_id, d in drafts.items() if req_id in parents}
        if len(ids) < len(req_ids):
            logger.error("vllm-specplug: requests %s have no usable grammar in the worker "
                         "(grammar_rows \"worker\"): sampled UNCONSTRAINED this step; "
                         "use grammar_rows \"scheduler\"", sorted(set(req_ids) - set(ids)))
            if not ids:
                return grammar_output
        row_of = {req_id: b for b, req_id in enumerate(input_batch.req_ids[:input_batch.num_reqs])}
        num_rows = [num_grammar_rows(input_batch, row_of[req_id]) for req_id in ids]
        if self.grammar_choices is not None and greedy_tree_batch(runner, input_batch):
            if len(ids) < self.choices_min_trees:  # "auto": the rows cost less this step
                self.grammar_choices.num_steps_with_rows += 1
            else:
                ids, num_rows = self._plan_choices(ids, grammars, drafts, parents, num_rows)
            if not ids:  # every one decided from the target's choices after its draws
                self.stats.worker_rows_seconds += time.perf_counter() - started
                return grammar_output
        bitmask = self.structured.grammars.manager.backend.allocate_token_bitmask(sum(num_rows))
        num_acceptable = self._fill_rows(ids, grammars, drafts, parents, num_rows, bitmask)
        self.stats.worker_rows += (len(ids), sum(1 for req_id in ids if req_id in drafts),
                                   self.structured.num_device_reads - num_reads,
                                   sum(num_rows) - len(ids) - sum(num_acceptable))
        self.stats.worker_rows_seconds += time.perf_counter() - started
        return merged_grammar_output(grammar_output, ids, bitmask.numpy(), num_acceptable)

    def _plan_choices(self, req_ids: list[str], grammars: dict, drafts: dict, parents: dict,
                      num_rows: list[int]) -> tuple[list[str], list[int]]:
        """`grammar_verify: "choices"`: the requests whose tree the worker
        knows go unmasked, their draws corrected after sampling
        (grammar_choices.py); returns the others, which keep their rows."""
        kept, kept_rows = [], []
        for req_id, n in zip(req_ids, num_rows):
            tree, tokens = parents.get(req_id), drafts.get(req_id)
            if tree is None or tokens is None or len(tree) < n or len(tokens) < n - 1:
                kept.append(req_id)
                kept_rows.append(n)
                continue
            self.grammar_choices.plan(req_id, grammars[req_id], list(tokens), list(tree), n)
        return kept, kept_rows

    def _fill_rows(self, req_ids: list[str], grammars: dict, drafts: dict, parents: dict,
                   num_rows: list[int], bitmask) -> list[int]:
        """Each request's rows, a chain's only as deep as `RowDepth` says
        drafts get accepted, a tree's for its first `tree_rows` drafts
        (None for both: every row); its acceptable drafts per request."""
        depth = (self.row_depth.begin_step() if self.row_depth is not None
                 else self.tree_rows)
        if depth is None:  # trees with every row: the step's bookkeeping at once
            walks = _step_tree_walks(req_ids, grammars, drafts, parents, num_rows, bitmask)
            if walks is not None:
                self.row_threads.run(walks.jobs, num_rows)
                walks.finish()
                return [rows - 1 for rows in num_rows]  # every slot: an invalid one's row forbids it
        offsets = np.cumsum([0] + num_rows)

        def plan(i: int):  # xgrammar's walks may go side by side (row_threads.py)
            req_id = req_ids[i]
            return plan_request_rows(grammars[req_id], req_id, bitmask[offsets[i]:offsets[i + 1]],
                                     drafts.get(req_id), parents.get(req_id), depth)

        num_acceptable = self.row_threads.fill(plan, num_rows)
        if self.row_depth is not None:  # what each one's last rows' drafts became, and these
            tracked = self.structured.grammars.tracked
            for req_id, acceptable in zip(req_ids, num_acceptable):
                output_len = tracked[req_id].num_accepted
                self.row_depth.observe(req_id, output_len)
                self.row_depth.filled(req_id, output_len, acceptable)
        return num_acceptable


def greedy_tree_batch(runner, input_batch) -> bool:
    """Whether this step's target tokens are the argmax of every node's
    logits, drawn by our tree sampler: every request greedy, none needing
    vLLM's full sampler (which samples the roots alone, masked by their
    rows), drafts in the batch (else vLLM's sampler runs), one sampling
    rank."""
    from vllm_specplug.integration.v2.tree_sampler import needs_full_sampler

    sampler = getattr(runner, "sampler", None)
    if (sampler is None or getattr(runner, "batch_sharder", None) is not None
            or not input_batch.num_draft_tokens):
        return False
    idx_np = input_batch.idx_mapping_np[:input_batch.num_reqs]
    return (bool((sampler.sampling_states.temperature.np[idx_np] == 0.0).all())
            and not needs_full_sampler(sampler, idx_np, False))


def _step_tree_walks(req_ids: list[str], grammars: dict, drafts: dict, parents: dict,
                     num_rows: list[int], bitmask: torch.Tensor) -> TreeWalks | None:
    """The step's trees laid out together (tree_walks.py) when every request
    has a tree of the same size with its drafts known; else None (request
    by request, `plan_request_rows`)."""
    if len(set(num_rows)) != 1 or any(req_id not in parents or req_id not in drafts
                                      or len(parents[req_id]) < num_rows[0]
                                      for req_id in req_ids):
        return None
    n = num_rows[0]
    return plan_tree_walks([grammars[req_id] for req_id in req_ids],
                           [drafts[req_id] for req_id in req_ids],
                           [parents[req_id][:n] for req_id in req_ids], bitmask)
