"""The drafter vLLM instantiates for `specplug_eagle3` (through `custom_class`).

Per step (after verification, in the worker): every request's newly verified
positions go into the head with the target's auxiliary hidden states there
(for a tree request: the root and the accepted path, at the positions KV
compaction moved them to), then every request that sampled a token gets an
EAGLE-2 tree from the head. The scheduler receives the tree's nodes as a flat
draft; `trees` keeps their parents for the next step's layout (tree_step.py).
Failures go through the same `ProposerGuard` as every proposer: a failing
head costs speculation, never the engine.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_specplug.integration import tree_step
from vllm_specplug.integration.config import selection_of
from vllm_specplug.integration.guard import ProposerGuard
from vllm_specplug.proposers.eagle3 import Eagle3TreeOptions
from vllm_specplug.proposers.eagle3_head import HeadRuntime
from vllm_specplug.proposers.eagle3_loading import load_head

logger = logging.getLogger("vllm_specplug.tree_drafter")


class TreeEagleDrafter:
    def __init__(self, vllm_config) -> None:
        selection = selection_of(vllm_config.speculative_config)
        if selection is None:
            raise RuntimeError("vllm-specplug tree drafter created without a proposer "
                               "selection: the plugin must be loaded in the front end")
        self.method = selection.method
        self.options = Eagle3TreeOptions(**selection.options)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.device = torch.device(str(vllm_config.device_config.device))
        self.guard = ProposerGuard(self.method, selection.max_proposer_failures)
        self.head_model = load_head(self.options.model)
        self.aux_layer_ids = tuple(self.head_model.config.aux_layer_ids)
        self.head: HeadRuntime | None = None
        # {req_id: (node token ids without the root, parents with the root)}
        self.trees: dict[str, tuple[list[int], np.ndarray]] = {}
        logger.info("vllm-specplug %s: head %s, topk=%d num_steps=%d num_draft_tokens=%d",
                    self.method, self.options.model, self.options.topk,
                    self.options.num_steps, self.options.num_draft_tokens)

    @property
    def failure_counts(self) -> dict[str, int]:
        return self.guard.failure_counts

    def load_model(self, target_model) -> None:
        """The head shares the target's token embedding (as vLLM's eagle3)."""
        head = self.head_model.to(self.device)
        self.head = HeadRuntime(head, target_model.embed_input_ids,
                                self.options.draft_temperature)

    def propose(self, *args, **kwargs):
        raise RuntimeError("vllm-specplug's model-runner hook is not installed in this "
                           "worker; the plugin did not register here")

    def on_request_removed(self, req_id: str) -> None:
        self.trees.pop(req_id, None)
        if self.head is not None:
            self.head.forget(req_id)

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids,
                           aux_hidden_states) -> list[list[int]]:
        batch = runner.input_batch
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        step = tree_step.current()
        tree_step.set_current(None)
        for req_id in scheduler_output.preempted_req_ids or ():
            self.on_request_removed(req_id)
        if self.guard.disabled or step is None or aux_hidden_states is None:
            return drafts
        aux = torch.cat([h[:step.num_tokens] for h in aux_hidden_states], dim=-1)
        ok, _ = self.guard.call("ingest", batch.req_ids, self._ingest, batch, step, aux)
        if not ok:
            for req_id in batch.req_ids:
                self.on_request_removed(req_id)
            return drafts
        rows = self._draftable(batch, sampled_token_ids)
        if rows and scheduler_output.num_spec_tokens_to_schedule > 0:
            req_ids = [batch.req_ids[i] for i in rows]
            self.guard.call("propose", req_ids, self._draft, batch, rows,
                            scheduler_output.num_spec_tokens_to_schedule, drafts)
        return drafts

    def _ingest(self, batch, step, aux: torch.Tensor) -> None:
        drafted = {r.row: r for r in step.requests}
        for row, req_id in enumerate(batch.req_ids):
            token_rows, positions = step.verified_rows(row, drafted.get(row))
            num_tokens = int(batch.num_tokens_no_spec[row])
            keep = positions + 1 < num_tokens  # the next token is known
            token_rows, positions = token_rows[keep], positions[keep]
            if len(positions) == 0:
                continue
            next_ids = torch.from_numpy(batch.token_ids_cpu[row, positions + 1].astype(np.int64))
            self.head.ingest(req_id, aux[torch.from_numpy(token_rows).to(aux.device)],
                             next_ids.to(self.device),
                             torch.from_numpy(positions).to(self.device))

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

    def _draft(self, batch, rows: list[int], allowance: int, drafts) -> None:
        num_tokens = batch.num_tokens_no_spec[rows].astype(np.int64)
        roots = torch.from_numpy(batch.token_ids_cpu[rows, num_tokens - 1].astype(np.int64))
        options = self.options
        tree = self.head.draft_trees([batch.req_ids[i] for i in rows], roots.to(self.device),
                                     torch.from_numpy(num_tokens - 1).to(self.device),
                                     options.topk, options.num_steps,
                                     options.num_draft_tokens)
        token_ids, parent_ids = tree.token_ids.cpu(), tree.parent_ids.cpu().numpy()
        for b, row in enumerate(rows):
            limit = min(allowance, options.num_draft_tokens - 1,
                        self.max_model_len - int(num_tokens[b]))
            nodes = token_ids[b, 1:1 + limit].tolist()
            drafts[row] = nodes
            self.trees[batch.req_ids[row]] = (nodes, parent_ids[b, :limit + 1].copy())
