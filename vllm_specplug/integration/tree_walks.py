"""A step's draft trees under a grammar, laid out and finished all at once
(issue 30): the bookkeeping around xgrammar's walks in a few numpy passes
over the step, not a Python loop per tree and node.

Each constrained tree's rows are filled by xgrammar's walk of the tree
(`GrammarMatcher.traverse_draft_tree`, one C++ call a tree, SGLang's
layout; grammar_trees.py). Around each walk the worker laid out its inputs
(each node's first child and next sibling) and, after it, read each node's
verdict from its parent's row, gave a stop token's node the full row and
each invalid node its nearest valid ancestor's row (`NativeWalk`). Per tree
that was 26 µs of Python beside 59 µs of C++ on a 17-node tree (this 2-core
CPU, SmolLM2's vocabulary, the JSON schema of benchmarks/json_schema.json):
a third of a step's grammar time on one thread, and all of it once the walks
run on several (row_threads.py). Here the step's T trees of N nodes are
arrays [T, N]; the result is the same rows, bit for bit, as tree after tree
(`NativeWalk.finish`; tests/test_tree_walks.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplug.integration.grammar_trees import _stop_token_ids


@dataclass
class TreeWalks:
    """T trees of N nodes, node 0 each tree's root (the request's last
    token, already in its grammar), a node's parent before it."""
    traverses: list[Callable]   # each tree's matcher's traverse_draft_tree
    layout: torch.Tensor        # [3, T, N] int64: first child, next sibling (-1 none), token (0 at the root)
    parents: np.ndarray         # [T, N] int64: -1 at the root
    rows: torch.Tensor          # [T * N, num_words] int32: tree t's rows at t * N (a view)
    stop_token_ids: list[int]   # the grammars' stop tokens (one set for all)

    @property
    def jobs(self) -> list[Callable[[], None]]:
        """Each tree's walk: the C++ call alone (any thread, row_threads.py)."""
        n = self.parents.shape[1]
        return [lambda t=t: self.traverses[t](self.layout[0, t], self.layout[1, t],
                                              self.layout[2, t], self.rows[t * n:(t + 1) * n])
                for t in range(len(self.traverses))]

    def finish(self) -> np.ndarray:
        """[T, N] bool: which nodes are valid, once every walk ran; the rows
        as `NativeWalk.finish` leaves them (read before any is changed)."""
        num_trees, n = self.parents.shape
        words = self.rows.numpy()  # a view
        tokens = self.layout[2].numpy()
        node_rows = np.arange(num_trees)[:, None] * n + np.arange(n)  # [T, N]: each node's row
        parent_rows = node_rows - np.arange(n) + np.maximum(self.parents, 0)  # the root: itself
        parent_words = words[parent_rows, tokens >> 5].view(np.uint32)
        valid = ((parent_words >> (tokens & 31).astype(np.uint32)) & 1).astype(bool)
        valid[:, 0] = True
        source = node_rows  # each node's nearest valid ancestor's row
        for _ in range(n):  # a level a pass: parents come first
            through = valid & valid.ravel()[parent_rows]
            nearest = np.where(through, node_rows, source.ravel()[parent_rows])
            if np.array_equal(through, valid) and np.array_equal(nearest, source):
                break
            valid, source = through, nearest
        stops = valid & np.isin(tokens, self.stop_token_ids)
        stops[:, 0] = False
        words[node_rows[stops]] = -1  # vLLM's full row for a terminated grammar
        invalid = ~valid
        words[node_rows[invalid]] = words[source[invalid]]  # sources are valid
        return valid


def plan_tree_walks(grammars: Sequence, draft_token_ids: Sequence[Sequence[int]],
                    parents: Sequence[Sequence[int]], rows: torch.Tensor) -> TreeWalks | None:
    """The step's walks, or None where any tree needs the walk one at a time
    (`plan_request_rows`): a grammar without xgrammar's walk or terminated,
    trees of different sizes, a draft unknown (-1) or outside the rows'
    vocabulary, stop tokens that differ between grammars. `rows`
    [T * N, num_words] int32 holds tree t's N rows at t * N."""
    num_trees = len(grammars)
    if not num_trees or len({len(p) for p in parents}) != 1:
        return None
    n = len(parents[0])
    if rows.shape[0] != num_trees * n or any(len(d) < n - 1 for d in draft_token_ids):
        return None
    traverses = [getattr(getattr(g, "matcher", None), "traverse_draft_tree", None)
                 for g in grammars]
    if any(t is None for t in traverses) or any(g.is_terminated() for g in grammars):
        return None
    stops = {_stop_token_ids(g) for g in grammars}
    tokens = np.zeros((num_trees, n), dtype=np.int64)
    tokens[:, 1:] = [d[:n - 1] for d in draft_token_ids]
    if len(stops) != 1 or tokens.min() < 0 or tokens.max() >= rows.shape[1] * 32:
        return None
    parent_ids = np.asarray(parents, dtype=np.int64).reshape(num_trees, n)
    layout = np.empty((3, num_trees, n), dtype=np.int64)
    layout[0], layout[1] = _first_child_next_sibling(parent_ids)
    layout[2] = tokens
    return TreeWalks(traverses, torch.from_numpy(layout), parent_ids, rows,
                     sorted(stops.pop()))


def _first_child_next_sibling(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[T, N] each node's first child and next sibling (-1: none), siblings
    in node order, as `native_walk` links them."""
    num_trees, n = parents.shape
    first_child = np.full((num_trees, n), -1, dtype=np.int64)
    next_sibling = np.full((num_trees, n), -1, dtype=np.int64)
    if n < 2:
        return first_child, next_sibling
    keys = (np.arange(num_trees)[:, None] * n + parents[:, 1:]).ravel()  # tree and parent
    nodes = np.broadcast_to(np.arange(1, n), (num_trees, n - 1)).ravel()
    order = np.argsort(keys, kind="stable")  # by parent, then node (already in order)
    keys, nodes = keys[order], nodes[order]
    same = keys[1:] == keys[:-1]
    next_flat = next_sibling.ravel()
    next_flat[(keys[:-1] // n * n + nodes[:-1])[same]] = nodes[1:][same]
    first = np.concatenate(([True], ~same))
    first_child.ravel()[keys[first]] = nodes[first]
    return first_child, next_sibling
