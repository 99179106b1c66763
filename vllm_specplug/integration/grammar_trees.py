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
from dataclasses import dataclass

import numpy as np
import torch

TREE_PARENTS_ATTR = "specplug_tree_parents"  # {req_id: parents, root included} on DraftTokenIds


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """Each node's children, in node order (parents[0] is the root's: -1)."""
    children: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)
    return children


def walk_tree(grammar, req_id: str, draft_token_ids: Sequence[int], parents: Sequence[int],
              visit: Callable[[int], None], rows: torch.Tensor | None = None) -> list[bool]:
    """Depth first from the root (node 0, the request's last token, already
    in `grammar`): `visit(node)` runs with the grammar in `node`'s path state,
    for every valid node. Node i > 0 carries draft_token_ids[i - 1]. Returns
    which nodes are valid; the grammar ends in the state it started in.

    With `rows` ([num_nodes, num_words] int32, the rows `visit` fills), a
    child is tested against its parent's row, one bit, before it is accepted
    (SGLang's `traverse_tree` does the same); without, the grammar validates
    it (an accept and a rollback more per child).

    `grammar` is vLLM's `StructuredOutputGrammar` (xgrammar, guidance, ...):
    `validate_tokens`, `accept_tokens`, `rollback`, `is_terminated`."""
    children = children_of(parents)
    valid = [False] * len(parents)
    valid[0] = True
    words = None if rows is None else rows.numpy()  # a view: numpy scalars, not tensor indexing

    def allowed(node: int, token: int) -> bool:
        if words is None:  # validate first: vLLM's backends log an error for a rejected accept
            return bool(grammar.validate_tokens([token]))
        return token_allowed(words[node], token)

    def descend(node: int) -> None:
        visit(node)
        for child in children[node]:
            token = int(draft_token_ids[child - 1])
            if (grammar.is_terminated() or not allowed(node, token)
                    or not grammar.accept_tokens(req_id, [token])):
                continue
            valid[child] = True
            descend(child)
            grammar.rollback(1)

    descend(0)
    return valid


def token_allowed(row, token: int) -> bool:
    """Whether a bitmask row ([num_words] int32 tensor or array, 32 tokens a
    word) allows `token`."""
    return 0 <= token < row.shape[0] * 32 and (int(row[token >> 5]) >> (token & 31)) & 1 == 1


def fill_tree_rows(grammar, req_id: str, draft_token_ids: Sequence[int],
                   parents: Sequence[int], rows: torch.Tensor,
                   fill_row: Callable[[int], None]) -> list[bool]:
    """Fill every node's verification row ([num_nodes, num_words] int32 CPU
    view of vLLM's bitmask) in its own path's grammar state; an invalid
    node gets its nearest valid ancestor's row, which forbids the token on
    its path. Returns which nodes are valid. `fill_row(node)` is vLLM's fill
    of one row (a full mask once the grammar has terminated).

    xgrammar walks the tree in C++, one call per tree
    (`GrammarMatcher.traverse_draft_tree`, SGLang's layout: `NativeWalk`);
    other backends walk it here, node by node. The rows are filled on the
    engine core's critical path (a deferred step waits for them), once per
    constrained request a step: the bookkeeping is on short lists, no scan
    of the rows."""
    walk = native_walk(grammar, draft_token_ids, parents, rows)
    if walk is not None:
        walk.run()
        return walk.finish()
    valid = walk_tree(grammar, req_id, draft_token_ids, parents, fill_row, rows)
    copy_invalid_rows(valid, parents, rows)
    return valid


def copy_invalid_rows(valid: Sequence[bool], parents: Sequence[int], rows: torch.Tensor) -> None:
    """Each invalid node's row: its nearest valid ancestor's."""
    if all(valid):
        return
    num_nodes = len(parents)
    source = list(range(num_nodes))  # each node's nearest valid ancestor (itself if valid)
    for node in range(1, num_nodes):  # parents come first
        if not valid[node]:
            source[node] = source[parents[node]]
    invalid = [node for node in range(num_nodes) if not valid[node]]
    words = rows.numpy()
    words[invalid] = words[[source[node] for node in invalid]]  # sources are valid: unchanged


STOP_IDS_ATTR = "_specplug_stop_token_ids"  # cached on vLLM's grammar object


def _stop_token_ids(grammar) -> frozenset[int]:
    """The xgrammar matcher's stop tokens, read once per request's grammar:
    the property builds a new list each call, 8 µs of a 16-node tree's
    50 µs walk on this CPU."""
    stops = getattr(grammar, STOP_IDS_ATTR, None)
    if stops is None:
        stops = frozenset(grammar.matcher.stop_token_ids)
        setattr(grammar, STOP_IDS_ATTR, stops)
    return stops


def native_walk(grammar, draft_token_ids: Sequence[int], parents: Sequence[int],
                rows: torch.Tensor) -> NativeWalk | None:
    """xgrammar's walk of one tree, its inputs laid out; None where the
    grammar has none (another backend), has terminated, or a draft is
    outside the rows' vocabulary (xgrammar reads the parent's bit)."""
    traverse = getattr(getattr(grammar, "matcher", None), "traverse_draft_tree", None)
    drafts = [int(token) for token in draft_token_ids[:len(parents) - 1]]
    if (traverse is None or grammar.is_terminated()
            or (drafts and (min(drafts) < 0 or max(drafts) >= rows.shape[1] * 32))):
        return None
    num_nodes = len(parents)
    first_child, next_sibling = [-1] * num_nodes, [-1] * num_nodes
    for node in range(num_nodes - 1, 0, -1):  # siblings linked in node order
        next_sibling[node] = first_child[parents[node]]
        first_child[parents[node]] = node
    tokens = [0] + drafts
    # one array for the three (a torch.tensor from a list each cost 4 µs a tree)
    layout = np.array((first_child, next_sibling, tokens), dtype=np.int64)
    return NativeWalk(traverse, *map(torch.from_numpy, layout), rows, list(parents), tokens,
                      _stop_token_ids(grammar))


@dataclass
class NativeWalk:
    """One tree's walk by xgrammar, laid out by `native_walk`: `run` is the
    C++ call alone (it holds no Python state but the request's own matcher
    and rows: any thread may run it, and xgrammar releases the GIL in it,
    integration/row_threads.py), `finish` the bookkeeping after it, on the
    caller's thread."""
    traverse: Callable      # the request's matcher's traverse_draft_tree
    first_child: torch.Tensor   # [num_nodes] int64: each node's first child, -1 none
    next_sibling: torch.Tensor  # [num_nodes] int64: each node's next sibling, -1 none
    token_ids: torch.Tensor     # [num_nodes] int64: 0 at the root, then the drafts
    rows: torch.Tensor          # [num_nodes, num_words] int32: the tree's rows (a view)
    parents: list[int]
    tokens: list[int]           # token_ids as a list
    stop_token_ids: frozenset[int]

    def run(self) -> None:
        self.traverse(self.first_child, self.next_sibling, self.token_ids, self.rows)

    def finish(self) -> list[bool]:
        """Which nodes are valid, once `run` filled the rows of the nodes
        their parent's row allows (xgrammar leaves the others alone). A node
        that ends the grammar (an accepted stop token) gets vLLM's full row
        for a terminated grammar here, where xgrammar leaves it empty; a
        node whose row is empty for another reason keeps it, as vLLM would.
        Each invalid node's row becomes its nearest valid ancestor's."""
        words = self.rows.numpy()  # a view
        token_array = self.token_ids.numpy()  # the walk's own input: a view
        parent_words = words[np.maximum(np.asarray(self.parents), 0),
                             token_array >> 5].view(np.uint32)
        allowed = ((parent_words >> (token_array & 31).astype(np.uint32)) & 1).tolist()
        valid = [True] * len(self.parents)
        for node in range(1, len(self.parents)):
            valid[node] = valid[self.parents[node]] and allowed[node] == 1
            if valid[node] and self.tokens[node] in self.stop_token_ids:
                words[node] = -1  # vLLM's full mask for a terminated grammar
        copy_invalid_rows(valid, self.parents, self.rows)
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

