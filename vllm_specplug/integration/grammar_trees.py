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

The scheduler part (`TreeGrammarScheduler`, integration/scheduler.py) needs
each tree's parents: the V1 runner attaches them to its drafts
(`TREE_PARENTS_ATTR` on `DraftTokenIds`, patches/gpu_model_runner.py).
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

