"""Greedy tree verification under a grammar decided from the target's
unmasked choices (verification/grammar_greedy.py) against the rows' way:
every node's row in its own path's state, the logits masked, the first
maximum taken at each node of the walk. Same accepted nodes and tokens on
random trees and logits (ties at the maximum and at the k-th logit made on
purpose), on xgrammar's JSON-schema grammar over a character vocabulary,
a stop token ending the grammar inside trees; the grammar ends where it
began. Each way of deciding a node (its argmax allowed, its top-k, its full
row) is taken in these cases."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import xgrammar as xgr

from vllm_specplug.verification.grammar_greedy import (GreedyGrammarWalk, masked_argmax,
                                                       node_choices, unpack_row,
                                                       xgrammar_take)
from vllm_specplug.verification.tree_greedy import follow_choices

from tests.test_tree_walks import EOS, TEXT, VOCAB, _grammar, compiled

__all__ = ["compiled"]  # a fixture


def _row(grammar) -> np.ndarray:
    """vLLM's row in the grammar's state: all allowed once terminated."""
    if grammar.is_terminated():
        return np.ones(len(VOCAB), dtype=bool)
    words = xgr.allocate_token_bitmask(1, len(VOCAB))
    grammar.fill_bitmask(words, 0)
    return unpack_row(words[0].numpy(), len(VOCAB))


def _path_tokens(parents: list[int], tokens: list[int], node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def _path_grammar(compiled, prefix: str, parents, tokens, node: int):
    """The grammar in `node`'s path's state; None: the path leaves it."""
    grammar = _grammar(compiled, prefix)
    for token in _path_tokens(parents, tokens, node):
        if not grammar.is_terminated() and not grammar.validate_tokens([token]):
            return None
        grammar.accept_tokens("r", [token])
    return grammar


def _masked_choice(compiled, prefix: str, parents, tokens, logits, node: int) -> int | None:
    """The rows' way at one node: its row in its path's state (None: the
    path leaves the grammar), the logits masked, the first maximum."""
    grammar = _path_grammar(compiled, prefix, parents, tokens, node)
    return None if grammar is None else masked_argmax(logits[node].numpy(), _row(grammar))


def _reference(compiled, prefix: str, parents, tokens, logits) -> tuple[list[int], list[int]]:
    return follow_choices(parents, tokens, lambda node: _masked_choice(
        compiled, prefix, parents, tokens, logits, node))


def _node_logits(rng, row: np.ndarray | None) -> torch.Tensor:
    """A node's logits: mostly an allowed maximum (as a target that knows
    the format), else a forbidden maximum with an allowed second, else
    random; a tie between two tokens now and then, often at the top."""
    logits = torch.randn(len(VOCAB), generator=torch.Generator().manual_seed(
        rng.randrange(1 << 30)))
    if row is not None and row.any() and not row.all():
        allowed, forbidden = np.flatnonzero(row).tolist(), np.flatnonzero(~row).tolist()
        pick, top = rng.random(), float(logits.max())
        if pick < 0.55:
            logits[rng.choice(allowed)] = top + 1
        elif pick < 0.85:
            logits[rng.choice(forbidden)], logits[rng.choice(allowed)] = top + 2, top + 1
    if rng.random() < 0.3:
        a, b = rng.sample(range(len(VOCAB)), 2)
        logits[b] = logits[a] = logits.max() if rng.random() < 0.5 else logits[a]
    return logits


def _random_case(rng, compiled, num_nodes: int):
    """A prefix of TEXT (its end included: stop tokens), each node's logits
    (`_node_logits`), and a tree whose drafts are often their parent's
    masked choice (deep accepted paths), else TEXT's next character or
    random."""
    prefix = TEXT[:rng.randrange(len(TEXT) + 1)]
    parents, tokens, logits = [-1], [0], []

    def add_logits(node: int) -> None:
        grammar = _path_grammar(compiled, prefix, parents, tokens, node)
        logits.append(_node_logits(rng, None if grammar is None else _row(grammar)))

    add_logits(0)
    for node in range(1, num_nodes):
        parent = rng.randrange(node)
        siblings = [tokens[c] for c in range(1, node) if parents[c] == parent]
        pick = rng.random()
        if pick < 0.5:
            token = _masked_choice(compiled, prefix, parents, tokens, torch.stack(logits), parent)
        else:
            at = len(prefix) + len(_path_tokens(parents, tokens, parent))
            token = VOCAB.index(TEXT[at]) if pick < 0.75 and at < len(TEXT) else None
        if token is None or token in siblings:
            token = rng.choice([t for t in range(len(VOCAB)) if t not in siblings])
        parents.append(parent)
        tokens.append(token)
        add_logits(node)
    return prefix, parents, tokens, torch.stack(logits)


class _Proxy:
    """vLLM's grammar behind a wrapper: the walk tries and takes a token
    with vLLM's two calls (`validate_tokens`, `accept_tokens`), not
    xgrammar's matcher in one (`xgrammar_take`)."""

    def __init__(self, grammar) -> None:
        self.grammar = grammar

    def __getattr__(self, name):
        return getattr(self.grammar, name)


def _walked(grammar, take: bool):
    """`grammar` as the walk is to see it, and the walk's way checked."""
    walked = grammar if take else _Proxy(grammar)
    assert (xgrammar_take(walked) is not None) == take
    return walked


@pytest.mark.parametrize("take", [True, False], ids=["one-call", "two-calls"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_accepted_path_is_the_rows_way_on_random_trees(compiled, k, take):
    rng = random.Random(k)
    ways = {"argmax": 0, "top": 0, "full": 0}
    for _ in range(60):
        prefix, parents, tokens, logits = _random_case(rng, compiled, rng.randrange(2, 14))
        grammar = _grammar(compiled, prefix)
        before = (grammar.num_processed_tokens, _row(grammar).tobytes())
        walk = GreedyGrammarWalk(_walked(grammar, take), len(VOCAB), node_choices(logits, k),
                                 lambda node: logits[node].numpy())
        path = walk.run(tokens, parents)
        expected = _reference(compiled, prefix, parents, tokens, logits)
        assert (path.accepted_node_ids, path.output_token_ids) == expected, (prefix, parents,
                                                                             tokens)
        assert (grammar.num_processed_tokens, _row(grammar).tobytes()) == before
        ways["top"] += path.num_top_choices
        ways["full"] += len(path.full_row_node_ids)
        ways["argmax"] += len(path.output_token_ids) - path.num_top_choices - len(
            path.full_row_node_ids)
    assert ways["argmax"] > 0 and ways["full"] > 0, ways
    assert ways["top"] > 0 or k == 1, ways  # k = 1: the top-k is the argmax alone


def test_a_tie_at_the_kth_logit_goes_to_the_full_row(compiled):
    """Top-2 at one node: a forbidden maximum, then an allowed token whose
    logit equals a smaller allowed token's outside the top-2: that smaller
    token is the masked choice, which only the full row shows."""
    grammar = _grammar(compiled, '{"topic": "H')  # in a string: most characters allowed
    allowed = np.flatnonzero(_row(grammar))
    forbidden = next(t for t in range(len(VOCAB)) if t not in allowed)
    small, large = int(allowed.min()), int(allowed.max())
    assert small < large
    logits = torch.zeros(1, len(VOCAB))
    logits[0, forbidden], logits[0, large], logits[0, small] = 3.0, 2.0, 2.0
    choices = node_choices(logits, 2)
    choices.top_ids[0] = [forbidden, large]  # as a top-k may order a tie
    path = GreedyGrammarWalk(grammar, len(VOCAB), choices, lambda n: logits[n].numpy()).run(
        [0], [-1])
    assert path.output_token_ids == [small] and path.full_row_node_ids == [0]


def test_allowed_tokens_tied_in_the_top_k_give_the_smaller_id(compiled):
    """Top-4 in the order a top-k may give a tie: a forbidden maximum, then
    two allowed tokens of one logit, larger id first, above the 4th: the
    smaller id, from the top-k alone."""
    grammar = _grammar(compiled, '{"topic": "H')
    allowed = np.flatnonzero(_row(grammar))
    forbidden = [t for t in range(len(VOCAB)) if t not in allowed]
    small, large = int(allowed.min()), int(allowed.max())
    assert small < int(allowed[1]) < large and forbidden
    logits = torch.zeros(1, len(VOCAB))
    logits[0, forbidden[0]], logits[0, large], logits[0, small] = 3.0, 2.0, 2.0
    logits[0, int(allowed[1])] = 1.0  # the 4th
    choices = node_choices(logits, 4)
    choices.top_ids[0, :3] = [forbidden[0], large, small]
    path = GreedyGrammarWalk(grammar, len(VOCAB), choices, lambda n: logits[n].numpy()).run(
        [0], [-1])
    assert path.output_token_ids == [small] and path.num_top_choices == 1
    assert path.full_row_node_ids == []


def test_a_full_row_of_the_wrong_width_names_the_shape(compiled):
    grammar = _grammar(compiled, "")
    logits = torch.zeros(1, len(VOCAB))
    logits[0, VOCAB.index("x")] = 1.0  # forbidden at the start, and alone in the top-1
    walk = GreedyGrammarWalk(grammar, len(VOCAB), node_choices(logits, 1),
                             lambda node: np.zeros(7, dtype=np.float32))
    with pytest.raises(ValueError, match=r"full_row\(0\) has shape \(7,\), expected \(96,\)"):
        walk.run([0], [-1])
    assert grammar.num_processed_tokens == 0


class _Refusing:
    """A grammar that allows `token` but then fails to take it (what a
    backend's fault looks like; vLLM's `accept_tokens` returns False)."""

    def __init__(self, grammar, token: int) -> None:
        self.grammar, self.token = grammar, token

    def __getattr__(self, name):
        return getattr(self.grammar, name)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return tokens != [self.token] and self.grammar.accept_tokens(request_id, tokens)


def test_a_token_the_grammar_allows_but_does_not_take_ends_the_path(compiled):
    """Its child is cut (no walk may accept it) and the token is the bonus:
    the tokens so far are still the masked choices, the grammar rolled back."""
    grammar = _grammar(compiled, '{"topic": "H')
    a, w = VOCAB.index("a"), VOCAB.index("w")
    logits = torch.zeros(3, len(VOCAB))
    logits[0, a], logits[1, w] = 5.0, 5.0  # the root chooses "a", node 1 "w"
    tokens, parents = [0, a, w], [-1, 0, 1]
    path = GreedyGrammarWalk(_Refusing(grammar, w), len(VOCAB), node_choices(logits, 2),
                             lambda node: logits[node].numpy()).run(tokens, parents)
    assert path.accepted_node_ids == [0, 1] and path.output_token_ids == [a, w]
    assert path.cut_node_ids == [2]
    assert grammar.num_processed_tokens == len('{"topic": "H')


def _advanced_by(compiled, prefix: str, output_token_ids: list[int]):
    """A fresh grammar at `prefix`, advanced by a step's output as the
    drafting pass advances it (`DraftGrammars.advance_known`: tokens after
    the grammar's end ignored): (grammar, its advances)."""
    grammar, num_advances = _grammar(compiled, prefix), 0
    for token in output_token_ids:
        if grammar.is_terminated():
            break
        assert grammar.accept_tokens("r", [token])
        num_advances += 1
    return grammar, num_advances


@pytest.mark.parametrize("take", [True, False], ids=["one-call", "two-calls"])
def test_a_kept_walk_leaves_the_grammar_where_its_output_takes_it(compiled, take):
    """`run(keep=True)` (grammar_verify "choices" on Model Runner V2): the
    same path, and the grammar left advanced by every emitted token, the
    bonus included, as the drafting pass would advance a grammar from the
    walk's start: the same count of advances, the same next row. The last
    case ends the grammar on its path (a stop token, then tokens the
    grammar ignores)."""
    rng = random.Random(7)
    stop_logits = torch.zeros(3, len(VOCAB))
    stop_logits[0, EOS], stop_logits[1, VOCAB.index("a")] = 5.0, 5.0
    stop_case = (TEXT, [-1, 0, 1], [0, EOS, VOCAB.index("a")], stop_logits)
    num_ended = 0
    for case in range(61):
        prefix, parents, tokens, logits = (stop_case if case == 60 else _random_case(
            rng, compiled, rng.randrange(2, 14)))
        grammar = _grammar(compiled, prefix)
        start = grammar.num_processed_tokens
        path = GreedyGrammarWalk(_walked(grammar, take), len(VOCAB), node_choices(logits, 3),
                                 lambda node: logits[node].numpy()).run(tokens, parents,
                                                                        keep=True)
        assert (path.accepted_node_ids, path.output_token_ids) == _reference(
            compiled, prefix, parents, tokens, logits)
        expected, num_advances = _advanced_by(compiled, prefix, path.output_token_ids)
        assert path.num_grammar_advances == num_advances
        assert grammar.num_processed_tokens == start + num_advances
        assert _row(grammar).tobytes() == _row(expected).tobytes()
        assert grammar.is_terminated() == expected.is_terminated()
        num_ended += grammar.is_terminated()
    assert num_ended > 0


@pytest.mark.parametrize("refused", ["draft", "bonus"])
def test_a_kept_walk_whose_token_is_refused_ends_where_it_began(compiled, refused):
    """A backend that allows a token and then refuses it (on the path: the
    child is cut; as the bonus: nothing else changes) leaves nothing kept:
    `num_grammar_advances` None, the grammar rolled back to its start."""
    prefix = '{"topic": "H'
    grammar = _grammar(compiled, prefix)
    a, w = VOCAB.index("a"), VOCAB.index("w")
    logits = torch.zeros(3, len(VOCAB))
    logits[0, a], logits[1, w] = 5.0, 5.0  # the root chooses "a", node 1 "w"
    tokens, parents = ([0, a, w], [-1, 0, 1]) if refused == "draft" else ([0, a], [-1, 0])
    path = GreedyGrammarWalk(_Refusing(grammar, w), len(VOCAB), node_choices(logits, 2),
                             lambda node: logits[node].numpy()).run(tokens, parents,
                                                                    keep=True)
    assert path.output_token_ids == [a, w] and path.num_grammar_advances is None
    assert path.cut_node_ids == ([2] if refused == "draft" else [])
    assert grammar.num_processed_tokens == len(prefix)


def test_a_drafted_token_twice_among_siblings_leads_to_the_first():
    """Siblings' tokens are distinct in our trees; where they are not, the
    first such child is the one a walk follows, as the reference walk's."""
    from vllm_specplug.verification.grammar_greedy import children_by_token

    children = children_by_token([0, 5, 6, 5, 7], [-1, 0, 0, 0, 1])
    assert children == {(0, 5): 1, (0, 6): 2, (1, 7): 4}
    assert children_by_token([0], [-1]) == {}
