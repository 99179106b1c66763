"""Draft trees under structured outputs: every node is checked, and its
verification row masked, in the grammar state of its own root path.

vLLM reads a request's drafts as a chain: its scheduler keeps the longest
grammar-valid prefix of the draft list (`StructuredOutputManager.
validate_tokens`) and builds the verification bitmask by advancing the
grammar through the list in order (`grammar_bitmask`). A flattened tree's
list is not a path: a sibling is read as its elder sibling's continuation,
so a valid sibling after an invalid one is dropped, and a node's row gets
the state after the list prefix, not after its own path. Where a sibling is
also valid as a continuation the target's masked choice at that node can
differ from plain decoding's: greedy outputs stop being exact.

Here the tree is walked depth first, as SGLang's EAGLE tree verification
does (`generate_token_bitmask` in its eagle_utils): a child is valid when
its parent is and the grammar accepts its token after the parent's path;
each valid node's row is filled in its own path's state, and the grammar is
rolled back before the next sibling. An invalid node keeps its place in the
list (the worker lays trees out from list prefixes), and its row is a copy
of its parent's: its parent's row forbids its token, so verification never
accepts it, greedy or stochastic. The list is cut after its last valid node.

The scheduler part (`TreeGrammarScheduler`) needs each tree's parents: the
V1 runner attaches them to its drafts (`TREE_PARENTS_ATTR` on
`DraftTokenIds`, patches/gpu_model_runner.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

TREE_PARENTS_ATTR = "specplug_tree_parents"  # {req_id: parents, root included} on DraftTokenIds


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """Each node's children, in node order (parents[0] is the root's: -1)."""
    children: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)
    return children


def walk_tree(grammar, req_id: str, draft_token_ids: Sequence[int], parents: Sequence[int],
              visit: Callable[[int], None]) -> list[bool]:
    """Depth first from the root (node 0, the request's last token, already
    in `grammar`): `visit(node)` runs with the grammar in `node`'s path state,
    for every valid node. Node i > 0 carries draft_token_ids[i - 1]. Returns
    which nodes are valid; the grammar ends in the state it started in.

    `grammar` is vLLM's `StructuredOutputGrammar` (xgrammar, guidance, ...):
    `validate_tokens`, `accept_tokens`, `rollback`, `is_terminated`."""
    children = children_of(parents)
    valid = [False] * len(parents)
    valid[0] = True

    def descend(node: int) -> None:
        visit(node)
        for child in children[node]:
            token = int(draft_token_ids[child - 1])
            # validate first: vLLM's backends log an error for a rejected accept
            if grammar.is_terminated() or not grammar.validate_tokens([token]):
                continue
            grammar.accept_tokens(req_id, [token])
            valid[child] = True
            descend(child)
            grammar.rollback(1)

    descend(0)
    return valid


def num_drafts_to_keep(valid: Sequence[bool]) -> int:
    """Drafts (list entries) up to the last valid node."""
    return max((node for node, ok in enumerate(valid) if ok), default=0)


def chain_prefix_length(parents: Sequence[int]) -> int:
    """Drafts that form a chain from the root (node i's parent is i - 1)."""
    length = 0
    while length + 1 < len(parents) and parents[length + 1] == length:
        length += 1
    return length


class TreeGrammarScheduler:
    """Mixin for a vLLM `Scheduler`: requests with structured output whose
    drafts came with tree parents are validated and masked per node (see
    the module docstring); every other request goes through vLLM's code.
    Requests whose grammar starts after a reasoning section keep vLLM's chain
    rules, on the tree's chain prefix only."""

    def _grammar_trees(self) -> dict[str, list[int]]:
        """{req_id: parents (root included) of the drafts it was given}."""
        if not hasattr(self, "_specplug_grammar_trees"):
            self._specplug_grammar_trees = {}
        return self._specplug_grammar_trees

    def update_draft_token_ids(self, draft_token_ids) -> None:
        from vllm.v1.outputs import DraftTokenIds

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
        if not ours:
            return super().get_grammar_bitmask(scheduler_output)
        # vLLM fills the root row of a draft list of -1 placeholders and leaves
        # the others open, without advancing the grammar; we fill those rows
        saved = {req_id: spec[req_id] for req_id in ours}
        spec.update({req_id: [-1] * len(drafts) for req_id, drafts in saved.items()})
        try:
            output = super().get_grammar_bitmask(scheduler_output)
        finally:
            spec.update(saved)
        if output is not None:
            self._fill_tree_rows(output, spec, ours)
        return output

    def _fill_tree_rows(self, output, spec: dict, ours: dict) -> None:
        manager, offset = self.structured_output_manager, 0
        rows = manager._grammar_bitmask
        for index, req_id in enumerate(output.structured_output_request_ids):
            drafts = spec.get(req_id, [])
            parents = ours.get(req_id)
            if parents is not None:
                grammar = self.requests[req_id].structured_output_request.grammar
                valid = walk_tree(grammar, req_id, drafts, parents, lambda node, base=offset:
                                  manager._fill_bitmasks(((grammar, base + node, True),)))
                for node in range(1, len(parents)):  # unreachable: the parent's row
                    if not valid[node]:
                        rows[offset + node].copy_(rows[offset + parents[node]])
                output.grammar_bitmask[offset:offset + len(parents)] = \
                    rows[offset:offset + len(parents)].numpy()
                if output.num_acceptable_drafts is not None:
                    output.num_acceptable_drafts[index] = len(drafts)
            offset += len(drafts) + 1
