"""The V1 runner's drafters for `specplug_eagle3` and `specplug_mtp` (vLLM
instantiates them through `custom_class`), thin adapters over the shared
`HeadDrafter` (head_drafter.py); Model Runner V2's is `v2/head_speculator.py`.

Per step (after verification, in the worker): every request's newly verified
positions go into the head (an EAGLE-3 head, or the target's MTP layer) with
the target's hidden states there (EAGLE-3: its auxiliary layers; MTP: its
last layer)
(for a tree request: the root and the accepted path, at the positions KV
compaction moved them to), then every request that sampled a token gets an
EAGLE-2 tree from the head. The scheduler receives the tree's nodes as a flat
draft; `trees` keeps their parents for the next step's layout (tree_step.py).
Failures go through the same `ProposerGuard` as every proposer: a failing
head costs speculation, never the engine.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from vllm_specplug.adaptive.tree_budget import TreeBudget
from vllm_specplug.integration.batch_schedule import batch_draft_scheduled
from vllm_specplug.integration.first_rank import first_rank_share
from vllm_specplug.integration.grammar_drafting import DraftGrammars
from vllm_specplug.integration.head_drafter import HeadDrafter
from vllm_specplug.integration.scheduler import choices_in_scheduler, masks_rows_per_node
from vllm_specplug.integration.v1 import tree_step
from vllm_specplug.integration.v1.deferred_ingest import DeferredIngest
from vllm_specplug.integration.v1.hooks import V1DrafterHooks
from vllm_specplug.integration.v1.prefix_rows import V1PrefixRows
from vllm_specplug.integration.v1.tree_choices import TreeChoices
from vllm_specplug.integration.v1.tree_profile import PROFILER
from vllm_specplug.integration.grammar_trees import chain_prefix_length
from vllm_specplug.proposers.lookup import graft_lookups, lookup_chains
from vllm_specplug.proposers.eagle3 import chain_parents
from vllm_specplug.proposers.eagle3_head import HeadRuntime


class TreeEagleDrafter(V1DrafterHooks):
    """The V1 runner's adapter over `HeadDrafter` (head_drafter.py)."""

    def __init__(self, vllm_config) -> None:
        self.drafter = HeadDrafter(vllm_config)
        self.method, self.options = self.drafter.method, self.drafter.options
        self.guard = self.drafter.guard
        self.aux_layer_ids = self.drafter.aux_layer_ids
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.device = self.drafter.device
        self.head: HeadRuntime | None = None
        # the drafter's rows of the target's full KV blocks: prefix-cache hits
        self.prefix = V1PrefixRows()
        self.lookup_counts = {"lookup_rows": 0, "lookup_nodes": 0}  # prompt lookups' drafts
        # {req_id: (node token ids without the root, parents with the root)}
        self.trees: dict[str, tuple[list[int], np.ndarray]] = {}
        # Benchmarks only (cost sweeps): verify the first N nodes of each
        # drafted tree, as a tree or re-linked as a chain (`set_draft_shape`).
        self.draft_shape: tuple[int, bool] | None = None
        # CUDA tree attention's buffers (set up by the runner patch, trees only)
        self.tree_buffers = None
        # this step's tree layout: set by the runner patch before the forward,
        # read by attention and verification, taken by `propose_for_runner`
        self.current_step: tree_step.TreeStep | None = None
        # a scheduler that checks grammars per tree node; under any other,
        # requests with structured output get the tree's chain prefix only
        self.grammar_aware = masks_rows_per_node(vllm_config.scheduler_config)
        # "adaptive": true: each step's tree sizes, down to no drafting pass
        self.adaptive = (TreeBudget(self.options.num_draft_tokens - 1)
                         if self.drafter.adaptive == "on" else None)
        # a sharded target: the first rank sizes the trees, from its own step
        # times, for every rank (first_rank.py)
        self.plan_share = first_rank_share(vllm_config) if self.adaptive is not None else None
        # under the budget, the verified rows of requests that do not draft
        # wait here until they do (deferred_ingest.py)
        self.deferred = DeferredIngest()
        # the drafter's own grammar per structured request: drafts ranked
        # among the tokens each node's path allows (grammar_drafting.py)
        self.grammars = (DraftGrammars(vllm_config,
                                       first_step_only=self.options.masks_first_step_only(
                                           model_runner_v2=False))
                         if self.options.masks_drafts() else None)
        # grammar_verify "choices" or "auto": greedy trees left unmasked, decided here
        self.tree_choices = (TreeChoices(vllm_config, self.grammars)
                             if choices_in_scheduler(vllm_config) is not None else None)
        # under our batch policy: each step's accepted paths, which teach it
        # every smaller tree size (`take_path_ranks`)
        self.report_paths = batch_draft_scheduled(vllm_config)
        self.path_ranks: tuple[int, np.ndarray] | None = None

    @property
    def failure_counts(self) -> dict[str, int]:
        return self.guard.failure_counts

    def load_model(self, target_model) -> None:
        """The head shares the target's token embedding (as vLLM's eagle3)."""
        self.head = self.drafter.load_model(target_model, self.max_num_seqs)

    def on_request_removed(self, req_id: str) -> None:
        self.trees.pop(req_id, None)
        if self.head is not None:
            self.head.forget(req_id)
        if self.adaptive is not None:
            self.adaptive.forget(req_id)
        self.deferred.forget(req_id)
        if self.grammars is not None:
            self.grammars.forget(req_id)
        if self.tree_choices is not None:
            self.tree_choices.forget(req_id)

    def target_hidden(self, hidden_states, aux_hidden_states, num_tokens: int):
        """[num_tokens, *] what the head reads per token (None: not there)."""
        return self.drafter.target_hidden(hidden_states, aux_hidden_states,
                                          slice(0, num_tokens))

    def setup_runner(self, runner, vllm_setup, target_has_aux_hidden_states: bool) -> None:
        """Aux hidden states for EAGLE-3 heads (an MTP layer reads the model
        output itself), tree verification and, on CUDA, the persistent
        buffers of tree attention (before graph capture)."""
        from vllm_specplug.integration import cuda_tree_attention
        from vllm_specplug.integration.v1 import cpu_tree_attention, cuda_tree_buffers
        from vllm_specplug.integration.v1.tree_sampler import TreeRejectionSampler

        if self.aux_layer_ids is not None:
            if not target_has_aux_hidden_states:
                raise RuntimeError(
                    f"{self.method}: the target {type(runner.get_model()).__name__} does "
                    "not expose auxiliary hidden states (vLLM's SupportsEagle3 interface)")
            runner.use_aux_hidden_state_outputs = True
            runner.model.set_aux_hidden_state_layers(self.aux_layer_ids)
        runner.rejection_sampler = TreeRejectionSampler(
            runner.sampler, runner.speculative_config, runner.device, runner)
        layers = runner.vllm_config.compilation_config.static_forward_context
        cpu_tree_attention.attach_step_source(layers, self)
        if runner.device.type == "cuda" and self.options.topk > 1:
            self.tree_buffers = cuda_tree_buffers.TreeAttentionBuffers(
                runner.max_num_reqs, self.options.num_draft_tokens, runner.device)
            cuda_tree_attention.attach(layers, self.tree_buffers)

    def after_prepare_inputs(self, runner, scheduler_output) -> None:
        """This step's tree layout (rope positions seq_len + depth, tree rows),
        read by attention and verification during the forward."""
        step = tree_step.build_step(runner, scheduler_output, self.trees)
        self.current_step = step
        if self.tree_buffers is not None:
            self.tree_buffers.update(step)
        PROFILER.mark("inputs_ready", len(step.num_computed), step.num_tokens)

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids,
                           outputs: dict) -> list[list[int]]:
        PROFILER.mark("draft_start")
        drafts = self._propose(runner, scheduler_output, sampled_token_ids,
                               outputs["hidden_states"], outputs["aux_hidden_states"])
        PROFILER.mark("draft_end")
        return drafts

    def _propose(self, runner, scheduler_output, sampled_token_ids,
                 hidden_states, aux_hidden_states) -> list[list[int]]:
        batch = runner.input_batch
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        step, self.current_step = self.current_step, None
        if self.adaptive is not None:
            self.adaptive.step_done(int(scheduler_output.total_num_scheduled_tokens),
                                    sum(map(len, scheduler_output.scheduled_spec_decode_tokens
                                            .values())))
        for req_id in scheduler_output.preempted_req_ids or ():
            self.on_request_removed(req_id)
        aux = None if step is None else self.target_hidden(hidden_states, aux_hidden_states,
                                                           step.num_tokens)
        allowance = scheduler_output.num_spec_tokens_to_schedule
        if self.guard.disabled or aux is None:
            if aux is not None and self.plan_share is not None:
                # a rank whose guard gave up still joins the sizes' broadcast,
                # which the other ranks wait in
                self._budgeted(batch, sampled_token_ids, allowance)
            return drafts
        if self.report_paths:
            self.path_ranks = step.path_ranks(self.options.num_draft_tokens - 1)
        planned = None  # the tree budget's {req_id: nodes} (None: no budget)
        if self.adaptive is not None:
            self._record_verified(step)
            planned = self._budgeted(batch, sampled_token_ids, allowance)
        elif allowance <= 0:
            # no request drafts this step (the batch policy or vLLM's table
            # chose no speculation): the head's ingest waits for the next
            # step that drafts, as a request the tree budget leaves out
            # (deferred_ingest.py); on CPU it was most of what a step at K = 0
            # cost over no speculation (docs/results/batch_draft_length_cpu_run5)
            planned = {}
        ok, _ = self.guard.call("ingest", batch.req_ids, self._ingest, batch, step, aux,
                                planned)
        if not ok:
            for req_id in batch.req_ids:
                self.on_request_removed(req_id)
            return drafts
        rows = self._draftable(batch, sampled_token_ids)
        sizes = None
        if planned is not None:
            rows = [row for row in rows if batch.req_ids[row] in planned]
            sizes = [planned[batch.req_ids[row]] for row in rows]
        if rows and allowance > 0:
            req_ids = [batch.req_ids[i] for i in rows]
            # a grammar's fault costs this step its masks, never the engine
            masks = self.guard.call("grammar_masks", req_ids, self._grammar_masks, runner,
                                    batch, rows, effect="this step drafts unmasked")[1]
            self.guard.call("propose", req_ids, self._draft, batch, rows, allowance, drafts,
                            sizes, masks)
            if not self.grammar_aware:
                self._chains_under_grammars(runner, rows, drafts)
        return drafts

    def _record_verified(self, step) -> None:
        """Each tree verified this step: the nodes it kept and its accepted
        path (node ids from 0, the root left out), for the tree budget."""
        for request in step.requests:
            accepted = step.accepted.get(request.req_id, [0])
            self.adaptive.verified(request.req_id, request.num_nodes - 1,
                                   [node - 1 for node in accepted[1:]])

    def _budgeted(self, batch, sampled_token_ids, allowance: int) -> dict[str, int]:
        """{req_id: nodes to keep} of the requests that draft this step, by
        the tree budget, decided before the head ingests (a request left out
        defers its ingest); none: no drafting pass."""
        rows = [row for row in range(len(batch.req_ids)) if sampled_token_ids[row]
                and int(batch.num_tokens_no_spec[row]) < self.max_model_len]
        if not rows or allowance <= 0:
            return {}
        max_nodes = min(allowance, self.options.num_draft_tokens - 1)
        sizes = self._plan([batch.req_ids[i] for i in rows], len(batch.req_ids), max_nodes)
        planned = {batch.req_ids[row]: size for row, size in zip(rows, sizes) if size > 0}
        for req_id in batch.req_ids:
            if req_id not in planned:
                self.trees.pop(req_id, None)
        return planned

    def _plan(self, req_ids: list[str], num_reqs: int, max_nodes: int) -> list[int]:
        """The tree budget's node counts for `req_ids`; on a sharded target
        the first rank's, broadcast: every rank drafts the same trees (a
        replicated head on the same tokens), and must keep the same nodes,
        as the scheduler sends every rank the first rank's draft tokens."""
        share = self.plan_share
        if share is None:
            return self.adaptive.plan(req_ids, num_reqs, max_nodes)
        sizes = torch.zeros(len(req_ids), dtype=torch.int64)
        if share.decides_here:
            sizes[:] = torch.tensor(self.adaptive.plan(req_ids, num_reqs, max_nodes))
        share.broadcast(sizes)
        return sizes.tolist()

    def _chains_under_grammars(self, runner, rows: list[int], drafts) -> None:
        """vLLM's scheduler reads a draft list as a chain: for requests with
        structured output, keep the tree's chain prefix (lossless there)."""
        for row in rows:
            req_id = runner.input_batch.req_ids[row]
            state = runner.requests.get(req_id)
            if (state is None or req_id not in self.trees
                    or state.sampling_params.structured_outputs is None):
                continue
            nodes, parents = self.trees[req_id]
            keep = chain_prefix_length(parents)
            drafts[row] = nodes[:keep]
            self.trees[req_id] = (nodes[:keep], parents[:keep + 1])

    def _ingest(self, batch, step, aux: torch.Tensor, planned: dict[str, int] | None) -> None:
        """Every request's newly verified positions, in one pass of the head;
        under the tree budget or at K = 0 (`planned`), those of requests
        that do not draft this step are deferred, and a drafting request's deferred rows
        go in first (deferred_ingest.py)."""
        verified = self._verified(batch, step)
        if planned is not None:
            deferred = {req_id for req_id, _, _, pos, _ in verified
                        if req_id not in planned and self.deferred.has_room(req_id, len(pos))}
            for req_id, _, token_rows, pos, next_ids in verified:
                if req_id in deferred:
                    self.deferred.defer(req_id, aux[torch.from_numpy(token_rows).to(aux.device)],
                                        next_ids, pos)
            verified = [v for v in verified if v[0] not in deferred]
            if self.adaptive is not None:
                self.adaptive.stats.num_deferred_rows = self.deferred.num_deferred
                self.adaptive.stats.num_dropped_rows = self.deferred.num_dropped
        if not verified:
            return
        table = batch.block_table[0]  # the target's KV blocks: prefix-cache hits
        req_ids = [v[0] for v in verified]
        hidden = aux[torch.from_numpy(np.concatenate([v[2] for v in verified])).to(aux.device)]
        next_ids, positions = [v[4] for v in verified], [v[3] for v in verified]
        if any(req_id in self.deferred.pending for req_id in req_ids):  # catch-ups
            rows = [self.deferred.with_pending(req_id, h, n, p) for req_id, h, n, p in
                    zip(req_ids, hidden.split([len(p) for p in positions]), next_ids, positions)]
            hidden = torch.cat([h for h, _, _ in rows])
            next_ids, positions = [n for _, n, _ in rows], [p for _, _, p in rows]
        for req_id, (_, row, *_), pos in zip(req_ids, verified, positions):
            self.prefix.adopt(self.head, req_id, table, row, int(pos[0]),
                              batch.token_ids_cpu[row])
        self.head.ingest_many(  # positions stay on the host: the head keeps them there
            req_ids, hidden, torch.from_numpy(np.concatenate(next_ids)).to(self.device),
            torch.from_numpy(np.concatenate(positions)), [len(p) for p in positions])
        self.prefix.store(self.head, req_ids, [v[1] for v in verified], positions, table,
                          batch.token_ids_cpu)

    def _verified(self, batch, step) -> list[tuple]:
        """[(req_id, batch row, token rows of this step, positions, next
        token ids)] of the rows whose next token is known, per request."""
        drafted = {r.row: r for r in step.requests}
        verified = []
        for row, req_id in enumerate(batch.req_ids):
            token_rows, pos = step.verified_rows(row, drafted.get(row))
            keep = pos + 1 < int(batch.num_tokens_no_spec[row])  # the next token is known
            if keep.any():
                verified.append((req_id, row, token_rows[keep], pos[keep],
                                 batch.token_ids_cpu[row, pos[keep] + 1].astype(np.int64)))
        return verified

    def _draftable(self, batch, sampled_token_ids) -> list[int]:
        rows = []
        for row, req_id in enumerate(batch.req_ids):
            num_tokens = int(batch.num_tokens_no_spec[row])
            if (sampled_token_ids[row] and num_tokens < self.max_model_len
                    and self.head.last_position(req_id) == num_tokens - 2):
                rows.append(row)
            else:
                self.trees.pop(req_id, None)
        return rows

    def _grammar_masks(self, runner, batch, rows: list[int]):
        """The drafting pass's logits hook for `rows` under structured
        outputs (grammar_drafting.py); None: no row has a grammar."""
        if self.grammars is None:
            return None
        grammars = [self.grammars.of_row(runner, row) for row in rows]
        return self.grammars.masks([batch.req_ids[i] for i in rows], grammars, self.head.layer,
                                   self.device)

    def _draft(self, batch, rows: list[int], allowance: int, drafts,
               sizes: list[int] | None = None, masks=None) -> None:
        """Trees for `rows`, each cut to its size in `sizes` (the tree
        budget's; None: the configured tree), drafted under the grammars'
        `masks` (None: unmasked)."""
        started = time.perf_counter()
        num_tokens = batch.num_tokens_no_spec[rows].astype(np.int64)
        roots = torch.from_numpy(batch.token_ids_cpu[rows, num_tokens - 1].astype(np.int64))
        options = self.options
        self.head.tree_logits_hook = masks
        try:
            tree = self.head.draft_trees([batch.req_ids[i] for i in rows],
                                         roots.to(self.device),
                                         torch.from_numpy(num_tokens - 1).to(self.device),
                                         options.topk, options.num_steps,
                                         options.num_draft_tokens)
        finally:
            self.head.tree_logits_hook = None
        token_ids, parent_ids = tree.token_ids.cpu(), tree.parent_ids.cpu()
        if self.adaptive is not None:  # the host copies waited for the pass
            self.adaptive.drafted(len(rows), time.perf_counter() - started)
        limits = [min(allowance, options.num_draft_tokens - 1,
                      self.max_model_len - int(num_tokens[b]),
                      options.num_draft_tokens if sizes is None else sizes[b])
                  for b in range(len(rows))]
        if options.prompt_lookup_min and self.draft_shape is None and (
                masks is None or self.drafter.is_tree):
            token_ids, parent_ids = token_ids.clone(), parent_ids.clone()
            self._graft_lookups(batch, rows, num_tokens, token_ids, parent_ids, limits)
        parent_ids = parent_ids.numpy()
        for b, row in enumerate(rows):
            limit = limits[b]
            parents = parent_ids[b, :limit + 1].copy()
            if self.draft_shape is not None:
                num_nodes, chain = self.draft_shape
                limit = min(limit, num_nodes - 1)
                parents = chain_parents(limit + 1) if chain else parents[:limit + 1]
            nodes = token_ids[b, 1:1 + limit].tolist()
            drafts[row] = nodes
            self.trees[batch.req_ids[row]] = (nodes, parents)

    def _graft_lookups(self, batch, rows: list[int], num_tokens: np.ndarray,
                       token_ids: torch.Tensor, parent_ids: torch.Tensor,
                       limits: list[int]) -> None:
        """Prompt lookups where the history repeats (lookup.py): a chain's
        nodes replaced, a tree's branch added, each within its first
        `limits[b]` drafts; a chain's not on steps whose drafts a grammar
        masked (lookup.py says why)."""
        options = self.options
        k = options.lookup_num_tokens
        looked_up, lengths = lookup_chains(
            batch.token_ids_cpu[rows, :int(num_tokens.max())], num_tokens,
            options.prompt_lookup_min, options.prompt_lookup_max, k)
        if not self.drafter.is_tree:  # a chain takes a whole lookup only
            lengths = np.where(lengths == k, lengths, 0)
        grafted = graft_lookups(token_ids, parent_ids, torch.from_numpy(looked_up),
                                torch.from_numpy(lengths),
                                torch.tensor(limits, dtype=torch.int64) + 1)
        self.lookup_counts["lookup_rows"] += int((lengths > 0).sum())
        self.lookup_counts["lookup_nodes"] += int(grafted.sum())

    def lookup_stats(self) -> dict[str, int] | None:
        """Requests and nodes drafted by prompt lookups so far (None: off)."""
        return dict(self.lookup_counts) if self.options.prompt_lookup_min else None

    def take_path_ranks(self) -> tuple[int, np.ndarray] | None:
        ranks, self.path_ranks = self.path_ranks, None
        return ranks

    def draft_tree_parents(self) -> dict[str, list[int]]:
        return {req_id: parents.tolist() for req_id, (_, parents) in self.trees.items()
                if chain_prefix_length(parents) < len(parents) - 1}

    def set_draft_shape(self, num_nodes: int | None, chain: bool = False) -> None:
        """Benchmarks: verify only the first `num_nodes` nodes (root included)
        of every drafted tree, re-linked as a chain when `chain` (a cost sweep
        over verification sizes in one engine; the tokens still come from the
        head, so this stays lossless). None: back to the configured tree."""
        if num_nodes is not None and not 1 <= num_nodes <= self.options.num_draft_tokens:
            raise ValueError(f"num_nodes={num_nodes}: choose 1..{self.options.num_draft_tokens}")
        self.draft_shape = None if num_nodes is None else (num_nodes, chain)


class TreeMtpDrafter(TreeEagleDrafter):
    """`specplug_mtp`: the target's own MTP layer drafts the trees (its
    loading is `MtpTreeProposer.load_drafter`), from the target's last hidden
    state (MiMo returns it before the final norm, as the MTP layer expects).
    The same adapter; a name of its own for configs that name it."""
