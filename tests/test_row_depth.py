"""A chain's verification rows in the worker only as deep as its drafts get
accepted (`RowDepth`, `grammar_row_depth: "auto"`, integration/worker_rows.py):
the depth it learns from the outputs it sees, the rows it fills (those it
fills equal the full fill's; past the depth none is acceptable, so output
is unchanged), and the worker's rows with it (the stand-in speculator of
tests/test_worker_rows.py). A tree's rows for its first drafts only
(`grammar_tree_rows`) likewise."""
from __future__ import annotations

import pytest
import torch

from vllm_specplug.integration.worker_rows import (MIN_OBSERVED, PROBE_EVERY, RowDepth,
                                                   fill_request_rows)
from vllm_specplug.proposers.base import ProposerConfigError
from vllm_specplug.proposers.eagle3 import Eagle3TreeOptions

from tests.test_grammar_trees_async import DRAFT_CHARS, PARENTS, K, _add
from tests.test_worker_rows import _bitmask, _ours, _speculator, tokens

__all__ = ["tokens"]  # a fixture


def _run(depth: RowDepth, out: dict[str, int], num_steps: int, accepted) -> list[int]:
    """`num_steps` steps of 4 requests with K known drafts each; `accepted(step,
    acceptable)`: the drafts a request's step accepts. Returns each step's depth."""
    depths = []
    for step in range(num_steps):
        d = depth.begin_step()
        depths.append(d)
        for req_id in out:
            depth.observe(req_id, out[req_id])
            acceptable = min(d, K)
            depth.filled(req_id, out[req_id], acceptable)
            out[req_id] += accepted(step, acceptable) + 1
    return depths


def test_the_depth_follows_how_far_chains_are_accepted():
    """Unknown shares: every row. Chains that reach draft 1 one step in 5
    and never draft 2: one row past the root, every row on probe steps
    only. Then every draft accepted: the probes see it, every row again."""
    depth = RowDepth(K)
    out = {f"r{i}": 10 for i in range(4)}
    depths = _run(depth, out, 200, lambda step, n: min(n, 1) if step % 5 == 0 else 0)
    assert depths[0] == K  # nothing known yet
    last = depths[-2 * PROBE_EVERY:]
    steps = range(201 - 2 * PROBE_EVERY, 201)  # `num_steps` of each
    assert [d for d, n in zip(last, steps) if n % PROBE_EVERY] == [1] * (len(last) - 2)
    assert [d for d, n in zip(last, steps) if n % PROBE_EVERY == 0] == [K, K]
    assert depth.offered[2] >= MIN_OBSERVED and depth.reached[2] == 0
    depths = _run(depth, out, 6 * PROBE_EVERY, lambda step, n: n)
    assert depths[-PROBE_EVERY:] == [K] * PROBE_EVERY


def test_an_output_that_did_not_grow_by_an_accepted_count_is_not_counted():
    """A request not verified on those rows (its output unchanged: not
    scheduled, preempted; or grown past them) teaches nothing; one without
    acceptable drafts is not followed."""
    depth = RowDepth(K)
    depth.begin_step()
    depth.filled("same", 5, 2)
    depth.filled("past", 5, 2)
    depth.filled("none", 5, 0)
    depth.begin_step()
    for req_id, length in (("same", 5), ("past", 9), ("none", 6), ("new", 3)):
        depth.observe(req_id, length)
    assert not depth.offered.any() and not depth.reached.any()
    depth.filled("ok", 5, 2)
    depth.begin_step()
    depth.observe("ok", 7)  # one draft accepted, and its bonus token
    assert depth.offered.tolist() == [0, 1, 1, 0, 0] and depth.reached.tolist() == [0, 1, 0, 0, 0]


def test_rows_past_the_depth_copy_the_last_and_are_not_acceptable(tiny_model_dir, tokens):
    """Drafts "a b d a" (language "abd" | "bc") at depth 2: rows 0-2 equal the
    full fill's, rows 3-4 row 2's, 2 drafts acceptable; unknown drafts stay
    unacceptable at any depth."""
    scheduler = _ours(tiny_model_dir, False)
    request = _add(scheduler, "chain")
    grammar = request.structured_output_request.grammar
    drafts = [tokens[c] for c in "abda"]
    full, capped = _bitmask(scheduler, K + 1), _bitmask(scheduler, K + 1)
    assert fill_request_rows(grammar, "chain", full, drafts, None) == K
    assert fill_request_rows(grammar, "chain", capped, drafts, None, max_drafts=2) == 2
    assert torch.equal(capped[:3], full[:3]) and not torch.equal(full[3], full[2])
    assert all(torch.equal(row, capped[2]) for row in capped[3:])
    assert fill_request_rows(grammar, "chain", capped, drafts, None, max_drafts=0) == 0
    assert all(torch.equal(row, full[0]) for row in capped)
    assert fill_request_rows(grammar, "chain", capped, [-1] * K, None, max_drafts=2) == 0
    assert grammar.num_processed_tokens == 0  # every walk rolled back


def test_the_workers_chain_rows_stop_at_the_learnt_depth(tiny_model_dir, tokens):
    """The worker's rows of a chain (no tree slots) with a depth of 1 learnt:
    the root's row and draft 1's, the rest copies; 1 draft acceptable; the
    rows it left unfilled counted; the request followed for the next step."""
    from vllm.v1.outputs import DraftTokenIds

    speculator, runner = _speculator(tiny_model_dir, tokens)
    speculator.tree_slots = None
    speculator.row_depth = RowDepth(K)
    speculator.row_depth.offered[:] = 100.0
    speculator.row_depth.reached[:] = [0.0, 20.0, 0.0, 0.0, 0.0]
    drafts = DraftTokenIds(["tree", "free"], [[tokens[c] for c in "cadb"]] * 2)
    runner.take_draft_token_ids = lambda: drafts
    grammar_output = speculator.verification_rows(runner, None)
    assert grammar_output.num_acceptable_drafts == [1]
    rows = torch.from_numpy(grammar_output.grammar_bitmask)
    grammar = speculator.structured.grammars.tracked["tree"].holder \
        .structured_output_request.grammar
    full = torch.zeros_like(rows)
    assert fill_request_rows(grammar, "tree", full, drafts.draft_token_ids[0], None) == K
    assert torch.equal(rows[:2], full[:2]) and all(torch.equal(r, rows[1]) for r in rows[2:])
    assert speculator.stats.worker_rows.tolist() == [1, 1, 1, K - 1]
    assert speculator.row_depth.this == {"tree": (1, 1)}  # its output: "b"


@pytest.mark.parametrize("value, message", [("deep", "must be one of auto, full"),
                                            ("", "must be one of auto, full"),
                                            (2, "must be str")])
def test_a_bad_row_depth_names_the_field_and_the_choices(tiny_eagle3_dir, value, message):
    with pytest.raises(ProposerConfigError, match=f"grammar_row_depth={value!r} {message}"):
        Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": str(tiny_eagle3_dir),
                                                        "grammar_row_depth": value})
    assert Eagle3TreeOptions.from_dict(  # the default: as deep as drafts get accepted
        "specplug_eagle3", {"model": str(tiny_eagle3_dir)}).grammar_row_depth == "auto"


def test_a_trees_first_drafts_get_the_full_fills_rows_and_the_rest_none_acceptable(
        tiny_model_dir, tokens):
    """The tree "a", "b", "c" under "b", "a" under "a" (language "abd" |
    "bc") with rows for its first 3 drafts: rows 0-3 the full fill's, row 4
    row 3's (not its own: the full fill gives it "a"'s), 3 acceptable."""
    scheduler = _ours(tiny_model_dir, False)
    request = _add(scheduler, "tree")
    grammar = request.structured_output_request.grammar
    drafts = [tokens[c] for c in DRAFT_CHARS]
    full, capped = _bitmask(scheduler, K + 1), _bitmask(scheduler, K + 1)
    assert fill_request_rows(grammar, "tree", full, drafts, PARENTS) == K
    assert fill_request_rows(grammar, "tree", capped, drafts, PARENTS, max_drafts=3) == 3
    assert torch.equal(capped[:4], full[:4]) and torch.equal(capped[4], capped[3])
    assert not torch.equal(full[4], full[3])
    assert fill_request_rows(grammar, "tree", capped, drafts, PARENTS, max_drafts=K) == K
    assert torch.equal(capped, full)
    assert grammar.num_processed_tokens == 0  # every walk rolled back


def test_the_workers_tree_rows_stop_at_grammar_tree_rows(tiny_model_dir, tokens):
    """The worker's rows of the stand-in's tree with `grammar_tree_rows` 2:
    the full fill's for the root and its first 2 drafts, the rest copies of
    the last; 2 drafts acceptable; the rows left unfilled counted."""
    speculator, runner = _speculator(tiny_model_dir, tokens)
    full = speculator.verification_rows(runner, None)
    speculator, runner = _speculator(tiny_model_dir, tokens)
    speculator.tree_rows = 2
    capped = speculator.verification_rows(runner, None)
    assert capped.num_acceptable_drafts == [2] and full.num_acceptable_drafts == [K]
    rows, full_rows = map(torch.from_numpy, (capped.grammar_bitmask, full.grammar_bitmask))
    assert torch.equal(rows[:3], full_rows[:3]) and all(torch.equal(r, rows[2]) for r in rows[3:])
    assert speculator.stats.worker_rows.tolist()[3] == K - 2


@pytest.mark.parametrize("value", [0, "some", True, 2.5])
def test_a_bad_tree_rows_value_names_the_field(tiny_eagle3_dir, value):
    with pytest.raises(ProposerConfigError, match=f"grammar_tree_rows={value!r} must be"):
        Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": str(tiny_eagle3_dir),
                                                        "grammar_tree_rows": value})


@pytest.mark.parametrize("given, kept", [(None, "full"), (8, 8)])
def test_tree_rows_default_to_every_nodes_row(tiny_eagle3_dir, given, kept):
    options = {} if given is None else {"grammar_tree_rows": given}
    assert Eagle3TreeOptions.from_dict("specplug_eagle3", {
        "model": str(tiny_eagle3_dir), **options}).grammar_tree_rows == kept


@pytest.mark.parametrize("value", [0, "some", True, 2.5])
def test_a_bad_choices_min_trees_value_names_the_field(tiny_eagle3_dir, value):
    with pytest.raises(ProposerConfigError,
                       match=f"grammar_choices_min_trees={value!r} must be"):
        Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": str(tiny_eagle3_dir),
                                                        "grammar_choices_min_trees": value})


@pytest.mark.parametrize("verify, min_trees", [("rows", None), ("choices", 1), ("auto", 8)])
def test_grammar_verify_gives_the_fewest_trees_a_step_for_the_choices(tiny_eagle3_dir, verify,
                                                                       min_trees):
    assert Eagle3TreeOptions.from_dict("specplug_eagle3", {
        "model": str(tiny_eagle3_dir), "grammar_verify": verify}).choices_min_trees() == min_trees


def test_model_runner_v2_refuses_auto_with_the_fix(tiny_eagle3_dir):
    """`grammar_verify: "auto"` differed from no speculation on an H100
    (docs/results/v2_grammar_auto_h100): refused there, naming what to use."""
    options = Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": str(tiny_eagle3_dir),
                                                              "grammar_verify": "auto"})
    with pytest.raises(ProposerConfigError, match="grammar_verify='auto' is not lossless"):
        options.check_model_runner_v2()
    for way in ("rows", "choices"):
        Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": str(tiny_eagle3_dir),
                                                        "grammar_verify": way}
                                    ).check_model_runner_v2()
