"""Grammar-aware trees under async scheduling (Model Runner V2's path, issue
30), on vLLM's real `AsyncScheduler` and `StructuredOutputManager` with the
tiny model's tokenizer and xgrammar: the step the engine core defers for
structured output (`update_draft_token_ids_in_output`, then
`get_grammar_bitmask`). The CPU platform turns async scheduling off, so the
scheduler is driven directly (as tests/test_scheduler_hook.py does); the
engine runs on the GPU: tests/gpu/test_grammar_trees_cuda.py.

The tree is the unit test's (test_grammar_trees_unit.py): language
"abd" | "bc", root children "a" and "b", "c" under "b", "a" under "a".
"""
from __future__ import annotations

import time

import pytest
import torch

from vllm_specplug.integration.batch_schedule import SpecplugBatchDraftTreeAsyncScheduler
from vllm_specplug.integration.grammar_trees import TREE_PARENTS_ATTR
from vllm_specplug.integration.scheduler import SpecplugTreeAsyncScheduler
from vllm_specplug.testing import scheduler_sim as sim

K = 4
DRAFT_CHARS, PARENTS = "abca", [-1, 0, 0, 2, 1]
PROMPT = [5, 6, 7, 8]
# ours under async scheduling: the trees' own, and the same with one tree
# size per step (`"adaptive": true` on Model Runner V2), which once lacked
# the deferred step's overrides and read constrained trees as lists
TREE_ASYNC = pytest.mark.parametrize(
    "scheduler_cls", [SpecplugTreeAsyncScheduler, SpecplugBatchDraftTreeAsyncScheduler],
    ids=["trees", "trees-one-size-per-step"])


@pytest.fixture(scope="module")
def tokens(tiny_model_dir) -> dict[str, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "abcd"}
    assert tokenizer.decode(list(ids.values())) == "abcd"  # one token a letter
    return ids


def _scheduler(scheduler_cls, model_dir):
    return sim.make_scheduler(scheduler_cls, str(model_dir), async_scheduling=True,
                              num_speculative_tokens=K)


def _add(scheduler, req_id: str):
    """A decoding request under the regex, its grammar compiled."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request

    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(regex="abd|bc"))
    params.structured_outputs._backend = "xgrammar"  # vLLM's default, as its front end picks
    request = Request(req_id, PROMPT, params, None)
    scheduler.structured_output_manager.grammar_init(request)
    for _ in range(600):  # compiled in vLLM's executor
        if request.structured_output_request.grammar is not None:
            break
        time.sleep(0.05)
    request.num_computed_tokens = len(PROMPT)  # past its prefill: decoding
    scheduler.requests[req_id] = request
    return request


def _step_output(req_ids: list[str]):
    """The scheduler output of a decode step with K placeholder drafts each."""
    from vllm.v1.core.sched.output import SchedulerOutput

    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = {r: K + 1 for r in req_ids}
    output.total_num_scheduled_tokens = (K + 1) * len(req_ids)
    output.scheduled_spec_decode_tokens = {r: [-1] * K for r in req_ids}
    output.has_structured_output_requests = True
    return output


def _drafts(req_ids: list[str], tokens: dict[str, int], with_parents: set[str]):
    from vllm.v1.outputs import DraftTokenIds

    drafts = DraftTokenIds(list(req_ids), [[tokens[c] for c in DRAFT_CHARS] for _ in req_ids])
    setattr(drafts, TREE_PARENTS_ATTR, {r: list(PARENTS) for r in with_parents})
    return drafts


def _path_row(scheduler, request, path: list[int]) -> torch.Tensor:
    """The bitmask row after `path`, from a fresh grammar of the same request."""
    import xgrammar as xgr

    grammar = scheduler.structured_output_manager.backend.compile_grammar(
        *request.structured_output_request.structured_output_key)
    assert grammar.accept_tokens("fresh", path)
    row = xgr.allocate_token_bitmask(1, 4096)
    grammar.fill_bitmask(row, 0)
    return row[0]


@TREE_ASYNC
def test_each_node_is_masked_on_its_own_path_in_the_deferred_step(scheduler_cls, tiny_model_dir, tokens):
    scheduler = _scheduler(scheduler_cls, tiny_model_dir)
    request = _add(scheduler, "tree")
    output = _step_output(["tree"])
    scheduler.update_draft_token_ids_in_output(_drafts(["tree"], tokens, {"tree"}), output)
    a, b, c = tokens["a"], tokens["b"], tokens["c"]
    # every node keeps its slot (the worker computed them): none cut, none invalid
    assert output.scheduled_spec_decode_tokens["tree"] == [a, b, c, a]
    assert not output.num_invalid_spec_tokens
    grammar_output = scheduler.get_grammar_bitmask(output)
    rows = torch.from_numpy(grammar_output.grammar_bitmask[:len(PARENTS)])
    assert torch.equal(rows[0], _path_row(scheduler, request, []))
    assert torch.equal(rows[1], _path_row(scheduler, request, [a]))
    assert torch.equal(rows[2], _path_row(scheduler, request, [b]))  # its own path: "c" next
    assert torch.equal(rows[3], _path_row(scheduler, request, [b, c]))
    assert torch.equal(rows[4], rows[1])  # "aa" is invalid: its parent's row forbids it
    assert not (int(rows[1][a // 32]) >> (a % 32)) & 1
    assert grammar_output.num_acceptable_drafts == [K]
    grammar = request.structured_output_request.grammar
    assert grammar.num_processed_tokens == 0  # the walk rolled the grammar back
    # a later step's bitmask built before its drafts arrive (placeholders)
    # reads no stale tree: vLLM's rows, no draft acceptable
    later = scheduler.get_grammar_bitmask(_step_output(["tree"]))
    assert later.num_acceptable_drafts == [0]


def test_vllm_reads_the_same_tree_as_a_list(tiny_model_dir, tokens):
    """What the async scheduler does without our subclass, and what ours
    does for a request whose drafts came without parents: vLLM's chain
    rules (the list is cut at "c", and "b"'s row is taken after "a b")."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    for scheduler_cls in (AsyncScheduler, SpecplugTreeAsyncScheduler):
        scheduler = _scheduler(scheduler_cls, tiny_model_dir)
        request = _add(scheduler, "list")
        output = _step_output(["list"])
        scheduler.update_draft_token_ids_in_output(_drafts(["list"], tokens, set()), output)
        assert output.scheduled_spec_decode_tokens["list"] == [tokens["a"], tokens["b"], -1, -1]
        assert output.num_invalid_spec_tokens == {"list": 2}
        rows = torch.from_numpy(scheduler.get_grammar_bitmask(output).grammar_bitmask)
        assert torch.equal(rows[2], _path_row(scheduler, request, [tokens["a"], tokens["b"]]))
        assert not torch.equal(rows[2], _path_row(scheduler, request, [tokens["b"]]))


@TREE_ASYNC
def test_a_request_whose_grammar_starts_later_gets_vllm_rules_on_the_chain_prefix(scheduler_cls, 
        tiny_model_dir, tokens, monkeypatch):
    """A grammar that starts after a reasoning section (vLLM's
    `_get_constraint_bounds` other than (0, 0)) is vLLM's to handle: our
    scheduler hands it the tree's chain prefix ("a"), never a sibling read
    as a continuation, and keeps no tree for the bitmask."""
    from vllm.v1.structured_output import ConstraintBounds

    scheduler = _scheduler(scheduler_cls, tiny_model_dir)
    _add(scheduler, "reasoning")
    manager = scheduler.structured_output_manager
    monkeypatch.setattr(manager, "_get_constraint_bounds",  # still reasoning
                        lambda request, spec_tokens, *args, **kwargs:
                        ConstraintBounds(len(spec_tokens) + 1, len(spec_tokens) + 1))
    output = _step_output(["reasoning"])
    scheduler.update_draft_token_ids_in_output(_drafts(["reasoning"], tokens, {"reasoning"}),
                                               output)
    assert output.scheduled_spec_decode_tokens["reasoning"] == [tokens["a"], -1, -1, -1]
    assert output.num_invalid_spec_tokens == {"reasoning": 3}
    assert not scheduler._grammar_trees()


@TREE_ASYNC
def test_a_tree_beside_a_list_in_one_step_gets_its_own_rows(scheduler_cls, tiny_model_dir, tokens):
    """vLLM fills the other requests' rows, ours follow: the id list says
    which rows are whose (workers map rows to requests by it)."""
    scheduler = _scheduler(scheduler_cls, tiny_model_dir)
    tree, listed = _add(scheduler, "tree"), _add(scheduler, "list")
    output = _step_output(["tree", "list"])
    scheduler.update_draft_token_ids_in_output(
        _drafts(["tree", "list"], tokens, {"tree"}), output)
    grammar_output = scheduler.get_grammar_bitmask(output)
    assert grammar_output.structured_output_request_ids == ["list", "tree"]
    assert grammar_output.num_acceptable_drafts == [2, K]  # "a b" of the list, the whole tree
    rows = torch.from_numpy(grammar_output.grammar_bitmask)
    assert rows.shape[0] == 2 * (K + 1)
    a, b, c = tokens["a"], tokens["b"], tokens["c"]
    assert torch.equal(rows[0], _path_row(scheduler, listed, []))
    assert torch.equal(rows[2], _path_row(scheduler, listed, [a, b]))
    tree_rows = rows[K + 1:]
    assert torch.equal(tree_rows[2], _path_row(scheduler, tree, [b]))
    assert torch.equal(tree_rows[3], _path_row(scheduler, tree, [b, c]))
    assert torch.equal(tree_rows[4], tree_rows[1])



@TREE_ASYNC
def test_every_tree_of_a_step_gets_the_rows_of_its_own_paths_in_its_own_place(scheduler_cls, 
        tiny_model_dir, tokens):
    scheduler = _scheduler(scheduler_cls, tiny_model_dir)
    req_ids = [f"tree{i}" for i in range(3)]
    requests = [_add(scheduler, req_id) for req_id in req_ids]
    output = _step_output(req_ids)
    scheduler.update_draft_token_ids_in_output(_drafts(req_ids, tokens, set(req_ids)), output)
    grammar_output = scheduler.get_grammar_bitmask(output)
    assert grammar_output.structured_output_request_ids == req_ids
    rows = torch.from_numpy(grammar_output.grammar_bitmask)
    assert rows.shape[0] == len(req_ids) * (K + 1)
    a, b, c = tokens["a"], tokens["b"], tokens["c"]
    for index, request in enumerate(requests):
        tree_rows = rows[index * (K + 1):(index + 1) * (K + 1)]
        for node, path in ((0, []), (1, [a]), (2, [b]), (3, [b, c])):
            assert torch.equal(tree_rows[node], _path_row(scheduler, request, path))
        assert torch.equal(tree_rows[4], tree_rows[1])
        assert request.structured_output_request.grammar.num_processed_tokens == 0


def test_only_schedulers_with_the_deferred_step_mask_rows_per_node_under_async(tiny_model_dir):
    """Under async scheduling the tree sampler trusts a node's row only from
    a scheduler with `SpecplugTreeAsyncScheduler`'s deferred step; a
    `TreeGrammarScheduler` on vLLM's `AsyncScheduler` alone reads trees as
    lists there (what the batch policy's tree scheduler once was)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_specplug.integration.scheduler import (SpecplugTreeScheduler,
                                                     TreeGrammarScheduler,
                                                     masks_rows_per_node)

    class ListReading(TreeGrammarScheduler, AsyncScheduler):
        pass

    config = _scheduler(SpecplugTreeAsyncScheduler, tiny_model_dir).vllm_config.scheduler_config
    verdicts = {}
    for cls in (SpecplugTreeAsyncScheduler, SpecplugBatchDraftTreeAsyncScheduler, ListReading,
                AsyncScheduler, SpecplugTreeScheduler):
        for async_scheduling in (True, False):
            config.scheduler_cls, config.async_scheduling = cls, async_scheduling
            verdicts[cls.__name__, async_scheduling] = masks_rows_per_node(config)
    assert {key for key, masks in verdicts.items() if masks} == {
        ("SpecplugTreeAsyncScheduler", True), ("SpecplugTreeAsyncScheduler", False),
        ("SpecplugBatchDraftTreeAsyncScheduler", True),
        ("SpecplugBatchDraftTreeAsyncScheduler", False),
        ("ListReading", False), ("SpecplugTreeScheduler", False)}


def test_the_trace_names_each_constrained_trees_way_through_a_deferred_step(
        tiny_model_dir, tokens, caplog, monkeypatch):
    """`scheduler.trace` at DEBUG (the grammar GPU tests keep it for the
    scheduler-rows engine): the drafts each request came with, whether it
    went as a tree or by vLLM's chain rules, its rows' valid nodes and what
    it sampled."""
    import logging

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler = _scheduler(SpecplugTreeAsyncScheduler, tiny_model_dir)
    # vLLM's own update wants the step's placeholders in flight: the trace is before it
    passed_on = []
    monkeypatch.setattr(AsyncScheduler, "update_from_output",
                        lambda self, *args: passed_on.append(args) or {})
    _add(scheduler, "tree"), _add(scheduler, "list")
    output = _step_output(["tree", "list"])
    with caplog.at_level(logging.DEBUG, logger="vllm_specplug.grammar_trace"):
        scheduler.update_draft_token_ids_in_output(
            _drafts(["tree", "list"], tokens, {"tree"}), output)
        scheduler.get_grammar_bitmask(output)
        scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=["tree", "list"], req_id_to_index={"tree": 0, "list": 1},
            sampled_token_ids=[[tokens["b"], tokens["c"]], [tokens["a"]]]))
    assert len(passed_on) == 1
    lines = [record.getMessage() for record in caplog.records]
    assert any(line.startswith("deferred step: tree ") and " tree slots=4 " in line
               and "parents=[-1, 0, 0, 2, 1]" in line for line in lines), lines
    assert any(line.startswith("deferred step: list ") and " vllm-chain " in line
               and "parents=None" in line for line in lines), lines
    assert "tree rows: tree valid=[1, 1, 1, 1, 0]" in lines, lines
    assert any(line.startswith("bitmask: tree ") and "tree=True" in line for line in lines)
    assert any(line.startswith("sampled: tree ") and f"tokens=[{tokens['b']}, {tokens['c']}]"
               in line for line in lines), lines
