"""`grammar_verify: "choices"` on the V1 runner: greedy trees under a
grammar verified from the target's unmasked choices.

The scheduler leaves a greedy request's tree unmasked and names it on the
step's `GrammarOutput` (`TreeGrammarScheduler._choice_trees`,
`CHOICE_TREES_ATTR`). The worker's tree sampler then corrects the draws on
each such tree's accepted path to their masked choice
(integration/grammar_choices.py, verification/grammar_greedy.py): the same
path and tokens every node's row would give. A batch that samples its
roots alone (logprobs, penalties: `tree_sampler.needs_full_sampler`) gets
those requests' root rows applied here instead, before vLLM's sampler. The
grammars are the worker's own (`DraftGrammars`, the drafter's when it
masks its drafts), advanced to each request's output.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import torch

from vllm_specplug.integration.grammar_choices import GrammarChoices
from vllm_specplug.integration.grammar_drafting import DraftGrammars
from vllm_specplug.integration.scheduler import CHOICE_TREES_ATTR
from vllm_specplug.verification.grammar_greedy import grammar_row

logger = logging.getLogger("vllm_specplug.tree_drafter")


class TreeChoices:
    """The V1 tree drafter's part: the step's chosen requests (`begin`),
    their draws corrected (`correct`) or their roots masked (`mask_roots`)."""

    def __init__(self, vllm_config, grammars: DraftGrammars | None = None) -> None:
        # the drafter's own when it masks drafts (one compile, one advance a
        # step: verification reads them at the root, before drafting does)
        self.grammars = grammars if grammars is not None else DraftGrammars(vllm_config)
        self.choices = GrammarChoices()
        self.req_ids: frozenset[str] = frozenset()

    def begin(self, grammar_output):
        """The step's `GrammarOutput` as vLLM's runner should see it: None
        where it has no row left (the chosen trees carry none)."""
        self.req_ids = frozenset(getattr(grammar_output, CHOICE_TREES_ATTR, None) or ())
        if grammar_output is not None and self.req_ids \
                and not grammar_output.structured_output_request_ids:
            return None
        return grammar_output

    def forget(self, req_id: str) -> None:
        self.grammars.forget(req_id)

    def correct(self, runner, step, metadata, logits: torch.Tensor,
                draws: torch.Tensor) -> list[int]:
        """`draws` [num_logits] int64, the argmax of every logits row, set to
        the masked choice on each chosen request's accepted path; returns
        the logits rows of nodes not to accept (`GrammarChoices.correct`)."""
        req_ids, self.req_ids = self.req_ids, frozenset()
        if not req_ids:
            return []
        cu = _cu_num_logits(metadata)
        draft_ids = metadata.draft_token_ids.cpu().tolist()
        trees = {request.req_id: request for request in step.requests}
        batch_req_ids = list(runner.input_batch.req_ids)
        for row, req_id in enumerate(batch_req_ids):
            grammar = self._grammar(runner, row, req_id) if req_id in req_ids else None
            if grammar is None:
                continue
            num_nodes, first = int(cu[row + 1] - cu[row]), int(cu[row]) - row
            tree = trees.get(req_id)
            parents = [-1] if tree is None else [int(p) for p in tree.parent_ids]
            if len(parents) != num_nodes:
                raise RuntimeError(f"request {req_id}: {num_nodes} logits rows for a tree "
                                   f"of {len(parents)} nodes")
            self.choices.plan(req_id, grammar, draft_ids[first:first + num_nodes - 1],
                              parents, num_nodes)
        return self.choices.correct(logits, draws, SimpleNamespace(
            req_ids=batch_req_ids, num_reqs=len(batch_req_ids), cu_num_logits_np=cu))

    def mask_roots(self, runner, metadata, logits: torch.Tensor) -> None:
        """Each chosen request's root row masked by its grammar (-inf where
        it forbids), as the scheduler's row would have masked it."""
        req_ids, self.req_ids = self.req_ids, frozenset()
        cu = _cu_num_logits(metadata)
        for row, req_id in enumerate(runner.input_batch.req_ids):
            grammar = self._grammar(runner, row, req_id) if req_id in req_ids else None
            if grammar is not None:
                allowed = torch.from_numpy(grammar_row(grammar, logits.shape[-1]))
                logits[int(cu[row])].masked_fill_(~allowed.to(logits.device), float("-inf"))

    def _grammar(self, runner, row: int, req_id: str):
        grammar = self.grammars.of_row(runner, row, verifying=True)
        if grammar is None:
            logger.error("vllm-specplug: request %s has no usable grammar in the worker "
                         "(grammar_verify \"choices\"): sampled UNCONSTRAINED this step; use "
                         "grammar_verify \"rows\"", req_id)
        return grammar


def _cu_num_logits(metadata) -> np.ndarray:
    """[num_reqs + 1]: each request's first logits row (a root, then its drafts)."""
    return np.concatenate([[0], np.cumsum(np.asarray(metadata.num_draft_tokens) + 1)])
