"""Grammar-aware draft trees, the walk itself, on vLLM's xgrammar grammar
class over a four-token vocabulary (no engine: the engine tests are in
test_tree_eagle_engine.py).

The tree is the case the issue asks for: a sibling that is also a valid
continuation of its elder sibling. Language: "abd" | "bc". Root children
"a" and "b"; "c" under "b". Read as a list (vLLM's chain rules), "b" follows
"a", so the row of node "b" gets the state after "ab" (next: "d") instead of
after "b" (next: "c"), and "c" is cut: a target accepting "b" would then be
masked to "d", which neither plain decoding nor the grammar allows.
"""
from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xgr
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

from vllm_specplug.integration.grammar_trees import (chain_prefix_length, fill_tree_rows,
                                                     num_drafts_to_keep, walk_tree)

VOCAB = ["a", "b", "c", "d", "</s>"]
A, B, C, D, EOS = range(5)
# drafts (nodes 1..): "a" and "b" under the root, "c" under "b", "a" under "a"
DRAFTS, PARENTS = [A, B, C, A], [-1, 0, 0, 2, 1]


def grammar() -> XgrammarGrammar:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_regex("abd|bc")
    return XgrammarGrammar(vocab_size=len(VOCAB), matcher=xgr.GrammarMatcher(compiled),
                           ctx=compiled)


def allowed(mask_row: torch.Tensor) -> set[int]:
    return {t for t in range(len(VOCAB)) if (int(mask_row[0]) >> t) & 1}


def path_mask(tokens: list[int]) -> set[int]:
    """The next-token mask after `tokens`, from a fresh matcher."""
    fresh = grammar()
    assert fresh.accept_tokens("fresh", tokens)
    row = xgr.allocate_token_bitmask(1, len(VOCAB))
    fresh.fill_bitmask(row, 0)
    return allowed(row[0])


def test_each_node_is_checked_and_masked_on_its_own_path():
    matcher = grammar()
    rows = xgr.allocate_token_bitmask(len(PARENTS), len(VOCAB))
    valid = walk_tree(matcher, "r", DRAFTS, PARENTS, lambda node: matcher.fill_bitmask(rows, node))
    assert valid == [True, True, True, True, False]   # "aa" is not in the language
    assert allowed(rows[0]) == {A, B}
    assert allowed(rows[1]) == path_mask([A]) == {B}
    assert allowed(rows[2]) == path_mask([B]) == {C}   # not "d": its own path, not "a b"
    assert allowed(rows[3]) == path_mask([B, C])
    assert num_drafts_to_keep(valid) == 3             # the invalid last node is cut
    assert matcher.num_processed_tokens == 0 and not matcher.is_terminated()  # rolled back


def test_the_list_order_reading_masks_the_sibling_wrongly():
    """What vLLM's chain rules do with the same list (the hazard fixed above)."""
    matcher = grammar()
    assert matcher.validate_tokens(DRAFTS) == [A, B]   # "c" dropped, "b" kept as "a"'s child
    assert path_mask([A, B]) == {D} != path_mask([B])


def test_chain_prefix():
    assert chain_prefix_length([-1, 0, 1, 2]) == 3
    assert chain_prefix_length(PARENTS) == 1
    assert chain_prefix_length([-1]) == 0


# A JSON-like grammar over single characters and a few longer tokens, for
# random trees: the C++ walk (xgrammar's traverse_draft_tree) and the Python
# walk must give the same validity and the same rows, bit for bit.
JSON_VOCAB = [*'{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz', '{"', '":', '",', 'true',
              'false', '"a"', '12', '</s>']
JSON_SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string"}, "n": '
               '{"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"]}')


def json_grammar() -> XgrammarGrammar:
    info = xgr.TokenizerInfo(JSON_VOCAB, stop_token_ids=[len(JSON_VOCAB) - 1])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(JSON_SCHEMA,
                                                             any_whitespace=False,
                                                             separators=(",", ":"))
    return XgrammarGrammar(vocab_size=len(JSON_VOCAB), matcher=xgr.GrammarMatcher(compiled),
                           ctx=compiled)


def random_tree(rng, prefix: list[int], num_nodes: int) -> tuple[list[int], list[int]]:
    """Parents and drafts; most drafts valid on their path, some not."""
    parents, drafts, paths = [-1], [], [[]]
    for node in range(1, num_nodes):
        parent = rng.randrange(node)
        path_allowed = sorted(path_mask_of(json_grammar, prefix + paths[parent]))
        if path_allowed and rng.random() < 0.8:
            token = rng.choice(path_allowed)
        else:
            token = rng.randrange(len(JSON_VOCAB))
        parents.append(parent)
        drafts.append(token)
        paths.append(paths[parent] + [token])
    return parents, drafts


def path_mask_of(make_grammar, tokens: list[int]) -> set[int]:
    fresh = make_grammar()
    for token in tokens:
        if fresh.is_terminated() or not fresh.validate_tokens([token]):
            return set()
        fresh.accept_tokens("fresh", [token])
    if fresh.is_terminated():
        return set()
    row = xgr.allocate_token_bitmask(1, len(JSON_VOCAB))
    fresh.fill_bitmask(row, 0)
    return {t for t in range(len(JSON_VOCAB)) if (int(row[0, t >> 5]) >> (t & 31)) & 1}


def python_walk_rows(matcher, drafts, parents):
    """The reference: the Python walk that validates each child, vLLM's fill."""
    rows = xgr.allocate_token_bitmask(len(parents), len(JSON_VOCAB))

    def fill(node):
        if matcher.is_terminated():
            rows[node].fill_(-1)
        else:
            matcher.fill_bitmask(rows, node)
    valid = walk_tree(matcher, "r", drafts, parents, fill)
    for node in range(1, len(parents)):
        if not valid[node]:
            rows[node].copy_(rows[parents[node]])
    return valid, rows


@pytest.mark.parametrize("seed", range(12))
def test_the_native_walk_equals_the_python_walk_on_random_trees(seed):
    rng = random.Random(seed)
    prefix = [JSON_VOCAB.index('{"')] + [JSON_VOCAB.index(c) for c in 'name":"ab",'] \
        if seed % 2 else []
    parents, drafts = random_tree(rng, prefix, num_nodes=rng.choice([5, 17, 33]))
    reference = json_grammar()
    assert reference.accept_tokens("r", prefix) or not prefix
    want_valid, want_rows = python_walk_rows(reference, drafts, parents)
    for native in (True, False):
        matcher = json_grammar()
        matcher.accept_tokens("r", prefix)
        if not native:  # the Python walk with bit tests (llguidance's path)
            matcher.matcher = _NoTraverse(matcher.matcher)
        rows = xgr.allocate_token_bitmask(len(parents), len(JSON_VOCAB)).fill_(7)
        valid = fill_tree_rows(matcher, "r", drafts, parents, rows,
                               lambda node: (rows[node].fill_(-1) if matcher.is_terminated()
                                             else matcher.fill_bitmask(rows, node)))
        assert valid == want_valid
        assert torch.equal(rows, want_rows)
        assert matcher.num_processed_tokens == len(prefix)  # rolled back
    assert any(want_valid[1:]) and (seed < 6 or not all(want_valid))


def test_a_stop_token_in_the_tree_ends_its_path_with_a_full_row():
    done = [JSON_VOCAB.index(c) for c in '{"name":"a","n":1,"ok":true}']
    eos, comma = len(JSON_VOCAB) - 1, JSON_VOCAB.index(',')
    parents, drafts = [-1, 0, 1, 0], [eos, comma, comma]  # eos -> (after it) ","; "," sibling
    matcher = json_grammar()
    assert matcher.accept_tokens("r", done)
    rows = xgr.allocate_token_bitmask(len(parents), len(JSON_VOCAB))
    valid = fill_tree_rows(matcher, "r", drafts, parents, rows,
                           lambda node: matcher.fill_bitmask(rows, node))
    assert valid == [True, True, False, False]
    assert bool((rows[1] == -1).all())          # terminated: vLLM's full mask
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[0])
    assert not matcher.is_terminated()


class _NoTraverse:
    """An xgrammar matcher without traverse_draft_tree (older xgrammar)."""

    def __init__(self, matcher):
        self._matcher = matcher

    def __getattr__(self, name):
        if name == "traverse_draft_tree":
            raise AttributeError(name)
        return getattr(self._matcher, name)


# Drafts that know the grammar (integration/grammar_drafting.py): each
# drafting step's logits masked per beam node to what the node's own path allows.

def _masks(grammars: list, draft_to_target=None, first_step_only: bool = False):
    from vllm_specplug.integration.grammar_drafting import PathMasks

    ids = torch.arange(len(VOCAB)) if draft_to_target is None else draft_to_target
    return PathMasks([f"r{b}" for b in range(len(grammars))], grammars, ids,
                     lambda rows: xgr.allocate_token_bitmask(rows, len(VOCAB)),
                     first_step_only)


def _finite(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_each_beam_node_drafts_what_its_own_path_allows():
    """Step 0 masks to the request's state; step 1's beam holds siblings "a"
    and "b" (each also valid after the other, read as a list) and each gets
    its own path's mask; a request without a grammar is left alone; a beam
    node whose path was ruled out (-inf) keeps its logits."""
    from vllm_specplug.verification.tree_build import extend_draft_pool

    matcher = grammar()
    masks = _masks([matcher, None])
    first = masks(torch.zeros(2, len(VOCAB)), None, None, None)
    assert _finite(first[0]) == {A, B} and _finite(first[1]) == set(range(len(VOCAB)))
    token_ids = torch.tensor([[[A, B, C]], [[A, B, C]]])
    logprobs = torch.tensor([[[-1.0, -2.0, float("-inf")]]] * 2)
    pooled = extend_draft_pool(None, token_ids, logprobs, torch.full((2, 1), -1))
    beam = torch.tensor([[0, 1, 2], [0, 1, 2]])
    second = masks(torch.zeros(2, 3, len(VOCAB)), None, pooled, beam)
    assert _finite(second[0, 0]) == path_mask([A]) == {B}
    assert _finite(second[0, 1]) == path_mask([B]) == {C}
    assert _finite(second[0, 2]) == set(range(len(VOCAB)))   # "c" was ruled out
    assert _finite(second[1, 0]) == set(range(len(VOCAB)))   # no grammar
    assert matcher.num_processed_tokens == 0                 # rolled back


def test_first_step_masks_mask_the_roots_step_and_leave_the_later_ones_alone():
    """`grammar_drafts: "first"`: the first step ranks what the request's
    state allows, the later steps the whole vocabulary (their logits are
    returned as given, the beam never read), the grammar unmoved."""
    from vllm_specplug.verification.tree_build import extend_draft_pool

    matcher = grammar()
    masks = _masks([matcher], first_step_only=True)
    first = masks(torch.zeros(1, len(VOCAB)), None, None, None)
    assert _finite(first[0]) == {A, B}
    pooled = extend_draft_pool(None, torch.tensor([[[A, B]]]), torch.tensor([[[-1.0, -2.0]]]),
                               torch.full((1, 1), -1))
    logits = torch.zeros(1, 2, len(VOCAB))
    assert masks(logits, None, pooled, torch.tensor([[0, 1]])) is logits
    assert _masks([matcher])(logits, None, pooled, torch.tensor([[0, 1]])) is not logits
    assert matcher.num_processed_tokens == 0


def test_a_path_the_grammar_refuses_is_left_alone_and_the_grammar_unmoved():
    """Below a row left unmasked (no allowed draft id) a child can carry a
    finite score and a token the grammar refuses: "a" then "c" here. Its
    row keeps its logits, and the grammar is not left part way down the
    path ("a" accepted, "c" refused), which would corrupt every later mask."""
    from vllm_specplug.verification.tree_build import extend_draft_pool

    matcher = grammar()
    masks = _masks([matcher])
    pooled = extend_draft_pool(None, torch.tensor([[[A]]]), torch.tensor([[[-1.0]]]),
                               torch.full((1, 1), -1))
    pooled = extend_draft_pool(pooled, torch.tensor([[[C, B]]]), torch.tensor([[[-1.0, -2.0]]]),
                               torch.tensor([[0]]))
    rows = masks(torch.zeros(1, 2, len(VOCAB)), None, pooled, torch.tensor([[1, 2]]))
    assert _finite(rows[0, 0]) == set(range(len(VOCAB)))      # "ac": refused, left alone
    assert _finite(rows[0, 1]) == path_mask([A, B]) == {D}     # "ab": its own path's mask
    assert matcher.num_processed_tokens == 0 and not matcher.is_terminated()


def test_masks_map_draft_ids_to_target_ids_and_never_empty_a_row():
    """A head with its own (smaller) vocabulary: draft id i is target token
    draft_to_target[i]; a state whose allowed tokens are all outside the
    draft vocabulary keeps its logits (all -inf would make the log-softmax NaN)."""
    matcher = grammar()
    draft_to_target = torch.tensor([B, D, EOS])    # the head drafts "b", "d", "</s>"
    row = _masks([matcher], draft_to_target)(torch.zeros(1, 3), None, None, None)
    assert _finite(row[0]) == {0}                    # "b" allowed, "a" not in the head
    assert matcher.accept_tokens("r", [B])           # next: "c" only, not in the head
    row = _masks([matcher], draft_to_target)(torch.zeros(1, 3), None, None, None)
    assert _finite(row[0]) == {0, 1, 2}


def test_the_drafters_grammar_follows_verified_tokens_and_stops_on_a_refusal():
    """`DraftGrammars.grammar_of` accepts each step's new output tokens once;
    a token its grammar refuses (its state went wrong) turns masking off for
    that request, and a failed compile does too: drafts go unmasked, the
    scheduler still checks them."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_specplug.integration.grammar_drafting import DraftGrammars, _Tracked

    grammars = DraftGrammars(vllm_config=None)
    matcher = grammar()
    grammars.tracked["r"] = _Tracked(SimpleNamespace(
        structured_output_request=SimpleNamespace(grammar=matcher)))
    assert grammars.grammar_of("r", None, np.array([B])) is matcher
    assert grammars.grammar_of("r", None, np.array([B])) is matcher  # nothing new
    assert matcher.num_processed_tokens == 1
    assert grammars.grammar_of("r", None, np.array([B, D])) is None  # "bd" is refused
    assert grammars.tracked["r"].broken and grammars.grammar_of("r", None, np.array([B])) is None
    grammars.tracked["e"] = _Tracked(SimpleNamespace(
        structured_output_request=SimpleNamespace(grammar=RuntimeError("compile"))))
    assert grammars.grammar_of("e", None, np.array([A])) is None
    assert grammars.grammar_of("free", SimpleNamespace(structured_outputs=None),
                               np.array([A])) is None
    assert "free" not in grammars.tracked


def test_the_drafters_grammar_takes_no_token_past_max_tokens():
    """A verify step samples past a request's max_tokens (vLLM drops those
    tokens; their rows were not the grammar's): the drafter's grammar
    accepts the output up to max_tokens and never refuses what lies past."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_specplug.integration.grammar_drafting import DraftGrammars, _Tracked

    grammars = DraftGrammars(vllm_config=None)
    matcher = grammar()
    grammars.tracked["r"] = _Tracked(SimpleNamespace(
        structured_output_request=SimpleNamespace(grammar=matcher, _grammar=matcher)))
    params = SimpleNamespace(max_tokens=1, structured_outputs=object())
    assert grammars.verifying_grammar("r", params, np.array([B, D])) is matcher  # "d" past
    assert matcher.num_processed_tokens == 1 and not grammars.tracked["r"].broken
    assert grammars.verifying_grammar("r", params, np.array([B, D, D])) is matcher
    assert grammars.tracked["r"].num_accepted == 1
