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

import torch
import xgrammar as xgr
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

from vllm_specplug.integration.grammar_trees import (chain_prefix_length, num_drafts_to_keep,
                                                     walk_tree)

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
