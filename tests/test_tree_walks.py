"""A step's trees under a grammar laid out and finished at once
(integration/tree_walks.py): the rows and verdicts are those of tree after
tree (`NativeWalk.finish`, what `plan_request_rows` runs), bit for bit, on xgrammar's
JSON-schema grammar over a character vocabulary: valid and invalid nodes,
nodes under invalid ones, a stop token that ends the grammar inside a tree,
trees of any shape. The worker's use of it runs on the GPU
(tests/gpu/test_grammar_trees_cuda.py)."""
from __future__ import annotations

import json
import random
import string

import numpy as np
import pytest
import torch
import xgrammar as xgr
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

from vllm_specplug.integration.grammar_trees import native_walk
from vllm_specplug.integration.row_threads import RowThreads
from vllm_specplug.integration.tree_walks import _first_child_next_sibling, plan_tree_walks
from vllm_specplug.public_sets import MT_BENCH_JSON_SCHEMA

VOCAB = list(string.printable[:95]) + ["</s>"]
EOS = len(VOCAB) - 1
TEXT = json.dumps({"topic": "Hawaii", "answer": "Beaches, volcanoes and food.",
                   "key_points": ["surf", "hike", "poke"]})


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(MT_BENCH_JSON_SCHEMA))


def _grammar(compiled, prefix: str) -> XgrammarGrammar:
    grammar = XgrammarGrammar(vocab_size=len(VOCAB), matcher=xgr.GrammarMatcher(compiled),
                              ctx=compiled)
    assert grammar.accept_tokens("r", [VOCAB.index(c) for c in prefix])
    return grammar


def _random_tree(rng, start: int, num_nodes: int) -> tuple[list[int], list[int]]:
    """(drafts, parents): each node's parent drawn among the earlier nodes;
    half the nodes on TEXT's next character after their parent's path (EOS
    past its end), the others random, so valid, invalid and stop nodes."""
    parents, drafts, depth = [-1], [], [0]
    for node in range(1, num_nodes):
        parent = rng.randrange(node)
        at = start + depth[parent]
        on_text = VOCAB.index(TEXT[at]) if at < len(TEXT) else EOS
        parents.append(parent)
        drafts.append(on_text if rng.random() < 0.5 else rng.randrange(len(VOCAB)))
        depth.append(depth[parent] + 1)
    return drafts, parents


def _one_by_one(compiled, prefixes, trees, num_nodes: int) -> tuple[torch.Tensor, list]:
    rows = xgr.allocate_token_bitmask(len(trees) * num_nodes, len(VOCAB))
    rows.zero_()
    verdicts = []
    for i, ((drafts, parents), prefix) in enumerate(zip(trees, prefixes)):
        grammar = _grammar(compiled, prefix)
        view = rows[i * num_nodes:(i + 1) * num_nodes]
        walk = native_walk(grammar, drafts, parents, view)
        walk.run()
        verdicts.append(walk.finish())
    return rows, verdicts


@pytest.mark.parametrize("num_nodes, seed", [(17, 0), (17, 1), (9, 2), (33, 3), (2, 4)])
def test_a_steps_trees_at_once_equal_tree_after_tree(compiled, num_nodes, seed):
    rng = random.Random(seed)
    # starts near TEXT's end too: trees whose paths end the grammar (EOS)
    starts = [rng.randrange(len(TEXT) - 3) for _ in range(20)] + [len(TEXT) - 2, len(TEXT) - 1]
    prefixes = [TEXT[:start] for start in starts]
    trees = [_random_tree(rng, start, num_nodes) for start in starts]
    want_rows, want_valid = _one_by_one(compiled, prefixes, trees, num_nodes)
    grammars = [_grammar(compiled, prefix) for prefix in prefixes]
    processed = [g.num_processed_tokens for g in grammars]
    rows = xgr.allocate_token_bitmask(len(trees) * num_nodes, len(VOCAB))
    rows.zero_()
    walks = plan_tree_walks(grammars, [d for d, _ in trees], [p for _, p in trees], rows)
    assert walks is not None
    RowThreads(2, min_rows=0).run(walks.jobs, [num_nodes] * len(trees))
    valid = walks.finish()
    assert torch.equal(rows, want_rows)
    assert valid.tolist() == want_valid
    assert [g.num_processed_tokens for g in grammars] == processed  # rolled back
    flat = valid[:, 1:].ravel()
    if num_nodes > 2:
        assert 0 < flat.sum() < flat.size  # valid and invalid nodes both
    stops = np.array([[d == EOS for d in [-1] + drafts] for drafts, _ in trees]) & valid
    if num_nodes > 9:
        assert stops.any()  # a tree's path ended the grammar: its row is the full one
        assert (rows.view(len(trees), num_nodes, -1)[torch.from_numpy(stops)] == -1).all()


@pytest.mark.parametrize("seed", range(4))
def test_children_and_siblings_are_linked_as_one_trees_walk(seed):
    rng = random.Random(seed)
    parents = [[-1] + [rng.randrange(node) for node in range(1, 12)] for _ in range(5)]
    first_child, next_sibling = _first_child_next_sibling(np.array(parents))
    for t, tree in enumerate(parents):
        walk = native_walk(_FakeGrammar(), [1] * 11, tree, torch.zeros(12, 1, dtype=torch.int32))
        assert first_child[t].tolist() == walk.first_child.tolist()
        assert next_sibling[t].tolist() == walk.next_sibling.tolist()


class _FakeGrammar:  # only the layout is read: native_walk's inputs
    class matcher:  # noqa: N801
        stop_token_ids = [0]

        @staticmethod
        def traverse_draft_tree(*args) -> None:
            raise AssertionError("not walked")

    @staticmethod
    def is_terminated() -> bool:
        return False


def test_steps_it_cannot_take_at_once_go_tree_by_tree(compiled):
    """None (the caller walks request by request): trees of two sizes, a
    draft unknown (-1), a terminated grammar, rows not T * N."""
    grammar = _grammar(compiled, TEXT[:5])
    rows = xgr.allocate_token_bitmask(6, len(VOCAB))
    chain = [-1, 0, 1]
    assert plan_tree_walks([grammar, grammar], [[1, 2], [1]], [chain, chain[:2]], rows) is None
    assert plan_tree_walks([grammar, grammar], [[1, 2], [1, -1]], [chain, chain], rows) is None
    assert plan_tree_walks([grammar], [[1, 2]], [chain], rows) is None
    ended = _grammar(compiled, TEXT)
    assert ended.accept_tokens("r", [EOS]) and ended.is_terminated()
    assert plan_tree_walks([grammar, ended], [[1, 2], [1, 2]], [chain, chain], rows) is None
    assert plan_tree_walks([grammar, grammar], [[1, 2], [3, 4]], [chain, chain], rows) is not None
