"""Constrained greedy trees verified from the target's unmasked choices on
Model Runner V2 (`grammar_verify: "choices"`; verification/grammar_greedy.py).

With rows in the worker (worker_rows.py) every node of a constrained tree
gets its grammar row before sampling: xgrammar's walks held the step at
every batch size under a JSON schema on the H200 (6.6 ms of host a step for
64 trees of 16 nodes, 1.1 ms for one; docs/results/v2_schema_tree_rows_h200).
In a batch that samples greedily, the worker leaves those requests'
logits unmasked instead (`GrammarChoices.plan`), and after the sampler's
draws (the argmax at every node) `correct` copies each such request's
argmax and top-k to the host (one wait for the forward), walks its
accepted path in its grammar (`GreedyGrammarWalk`), and sets the draws on
that path to their masked choices. The tree sampler's walk then follows
exactly the path that every node's row would give (it visits only nodes of
that path, whose draws are now the masked argmax), and emits the same
tokens. Off the path a draw may be a forbidden token: no walk reads it.

A request whose drafts or parents the worker does not know keeps its rows
(the walk on the device would read drafts the host did not see).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplug.verification.grammar_greedy import GreedyGrammarWalk, NodeChoices

TOP_K = 8  # choices per node copied to the host: the argmax's runners-up


@dataclass
class PlannedTree:
    """A constrained request left unmasked this step (`GrammarChoices.plan`)."""
    req_id: str
    grammar: object           # vLLM's grammar, advanced to the request's output
    token_ids: list[int]      # [num_nodes]: 0 at the root, then the scheduled drafts
    parents: list[int]        # [num_nodes]: -1 at the root


class GrammarChoices:
    """The step's planned requests, then their draws corrected (`correct`)."""

    def __init__(self, top_k: int = TOP_K, keep=None) -> None:
        """`keep(req_id, tokens, num_advances) -> bool`: takes a request's
        grammar as its walk left it, advanced by the `tokens` it emitted
        (`DraftGrammars.keep_known`); False: the walk's advances are rolled
        back. None: every walk ends where it began."""
        self.top_k = top_k
        self.keep = keep
        self.planned: dict[str, PlannedTree] = {}
        # {req_id: the tokens the step emitted} of the last `correct`, for the
        # drafting pass that follows (`take_emitted`)
        self.emitted: dict[str, list[int]] = {}
        # requests decided so, nodes decided from their top-k, from their full row
        self.counts = np.zeros(3, dtype=np.int64)
        # greedy steps left to every node's row, too few trees (grammar_verify "auto")
        self.num_steps_with_rows = 0

    def forget(self) -> None:
        self.planned, self.emitted = {}, {}

    def take_emitted(self) -> dict[str, list[int]]:
        """{req_id: accepted drafts, then the bonus token} of each request
        the last `correct` decided, whose path ended as its walk did (no
        cut node): what the tree sampler emits for it. Once; then cleared.
        The drafting pass advances those grammars by them instead of
        reading the outputs from the device (a wait for this step's
        sampling: StructuredRequests.root_bitmask)."""
        emitted, self.emitted = self.emitted, {}
        return emitted

    def plan(self, req_id: str, grammar, drafts: list[int], parents: list[int],
             num_rows: int) -> None:
        """`req_id`'s tree this step: its first `num_rows` nodes are verified."""
        self.planned[req_id] = PlannedTree(req_id, grammar, [0, *drafts[:num_rows - 1]],
                                           list(parents[:num_rows]))

    def correct(self, logits: torch.Tensor, target_tokens: torch.Tensor,
                input_batch) -> list[int]:
        """`target_tokens` [num_logits] int64 (the sampler's argmax at every
        logits row) set to the masked choice on each planned request's
        accepted path; `logits` [num_logits, vocab] are the rows it drew from.
        Returns the logits rows of nodes the walk must not accept
        (`GrammarPath.cut_node_ids`). One copy to the host, at most one back."""
        planned, self.planned = self.planned, {}
        self.emitted = {}
        if not planned:
            return []
        batch_rows = {req_id: b for b, req_id in
                      enumerate(input_batch.req_ids[:input_batch.num_reqs])}
        trees = [tree for req_id, tree in planned.items() if req_id in batch_rows]
        starts = [int(input_batch.cu_num_logits_np[batch_rows[t.req_id]]) for t in trees]
        choices = self.host_choices(logits, target_tokens)
        fixes: list[tuple[int, int]] = []
        cut: list[int] = []
        for start, tree in zip(starts, trees):
            num_nodes = len(tree.parents)
            path = _walk(tree, logits, start, _slice(choices, start, num_nodes),
                         self.keep is not None)
            argmax = choices.argmax_ids[start:start + num_nodes]
            fixes += [(start + node, token) for node, token in
                      zip(path.accepted_node_ids, path.output_token_ids) if token != argmax[node]]
            cut += [start + node for node in path.cut_node_ids]
            if not path.cut_node_ids:
                self.emitted[tree.req_id] = path.output_token_ids
                self._keep_or_roll_back(tree, path)
            self.counts += (1, path.num_top_choices, len(path.full_row_node_ids))
        if fixes:  # rows and tokens in one upload
            at, tokens = torch.tensor(fixes, dtype=torch.int64).to(logits.device).unbind(1)
            target_tokens[at] = tokens.to(target_tokens.dtype)
        return cut

    def _keep_or_roll_back(self, tree: PlannedTree, path) -> None:
        """A walk that kept its advances hands them on (`keep`), or undoes
        them where they cannot be taken: the grammar must then be where it
        began, for the output to advance it."""
        advances = path.num_grammar_advances
        if advances is None:
            return
        kept = False
        try:
            kept = self.keep(tree.req_id, path.output_token_ids, advances)
        finally:
            if not kept:
                tree.grammar.rollback(advances)

    def host_choices(self, logits: torch.Tensor, target_tokens: torch.Tensor) -> NodeChoices:
        """The argmax and top-k of every logits row, on the host in one
        copy, one wait (`bench offline --phases` times it as the grammar's
        wait); a free request's rows come along (a few KB), which spares an
        upload of the planned rows' indices. The top-k runs over the rows
        in their own dtype (a gather of the rows first would copy [rows,
        vocab] logits: 214 MB in float32 for 64 trees of 17 nodes over
        SmolLM2's vocabulary); a bfloat16 logit is exact in float32, so
        ties and order are the draws' own."""
        k = min(self.top_k, logits.shape[-1])
        top = torch.topk(logits, k, dim=-1)
        values = top.values.float().view(torch.int32).to(torch.int64)  # bits, not values
        packed = torch.cat([target_tokens[:, None].to(torch.int64), top.indices, values], dim=1)
        host = packed.cpu().numpy()
        return NodeChoices(host[:, 0], host[:, 1:1 + k],
                           host[:, 1 + k:].astype(np.int32).view(np.float32))


def _slice(choices: NodeChoices, offset: int, num_nodes: int) -> NodeChoices:
    part = slice(offset, offset + num_nodes)
    return NodeChoices(choices.argmax_ids[part], choices.top_ids[part], choices.top_logits[part])


def _walk(tree: PlannedTree, logits: torch.Tensor, start: int, choices: NodeChoices,
          keep: bool = False):
    def full_row(node: int) -> np.ndarray:  # rare: the argmax and its top-k all forbidden
        return logits[start + node].float().cpu().numpy()

    walk = GreedyGrammarWalk(tree.grammar, logits.shape[-1], choices, full_row, tree.req_id)
    return walk.run(tree.token_ids, tree.parents, keep)
