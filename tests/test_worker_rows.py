"""A constrained step's verification rows filled in the worker
(`grammar_rows: "worker"`, integration/worker_rows.py), on CPU: the
scheduler side on vLLM's real `AsyncScheduler` (ours on it) with the tiny
model's tokenizer and xgrammar; the worker side's rows against the rows the
scheduler's deferred step fills for the same drafts. vLLM's CPU platform
turns async scheduling off, so the scheduler is driven directly (as
tests/test_grammar_trees_async.py does); the engine runs on the GPU:
tests/gpu/test_grammar_trees_cuda.py.

The tree is test_grammar_trees_async's: language "abd" | "bc", root children
"a" and "b", "c" under "b", "a" under "a" (invalid).
"""
from __future__ import annotations

import json
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.integration.scheduler import (SpecplugTreeAsyncScheduler,
                                                 merged_grammar_output, rows_in_worker)
from vllm_specplug.integration.row_threads import RowThreads
from vllm_specplug.integration.worker_rows import WORKER_ROWS_ATTR, fill_request_rows

from tests.test_grammar_trees_async import (DRAFT_CHARS, K, PARENTS, PROMPT, _add, _drafts,
                                            _path_row, _scheduler, _step_output, tokens)

__all__ = ["tokens"]  # a fixture


def _ours(model_dir, in_worker: bool = True):
    scheduler = _scheduler(SpecplugTreeAsyncScheduler, model_dir)
    scheduler._specplug_rows_in_worker = in_worker  # rows_in_worker's verdict (tested below)
    return scheduler


def _waiting(scheduler, req_id: str):
    """A new request under the regex, its grammar compiled, through
    `add_request` (the engine core compiles before it adds)."""
    request = _add(scheduler, req_id)
    del scheduler.requests[req_id]
    request.num_computed_tokens = 0
    scheduler.add_request(request)
    return request


def test_a_step_with_tokens_in_flight_is_not_deferred_and_its_rows_are_the_workers(
        tiny_model_dir):
    """Prefill, then the next step scheduled before its output arrives (the
    engine core's batch queue): vLLM's scheduler defers the second step's
    bitmask; ours names the request for the worker and fills no row."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    deferred = {}
    for name, make in (("vllm", lambda d: _scheduler(AsyncScheduler, d)),
                       ("ours, rows in the scheduler", lambda d: _ours(d, False)),
                       ("ours", _ours)):
        scheduler = make(tiny_model_dir)
        _waiting(scheduler, "r")
        prefill = scheduler.schedule()
        assert prefill.num_scheduled_tokens == {"r": len(PROMPT)}
        assert not prefill.pending_structured_output_tokens
        assert not getattr(prefill, WORKER_ROWS_ATTR, None)
        # the prefill's own row is the scheduler's: it knows the request in full
        assert scheduler.get_grammar_bitmask(prefill).structured_output_request_ids == ["r"]
        decode = scheduler.schedule()
        assert decode.num_scheduled_tokens == {"r": 1 + K}
        deferred[name] = decode.pending_structured_output_tokens
        if name == "ours":
            assert getattr(decode, WORKER_ROWS_ATTR) == ["r"]
            assert scheduler.get_grammar_bitmask(decode) is None
    assert deferred == {"vllm": True, "ours, rows in the scheduler": True, "ours": False}


def test_the_scheduler_fills_the_rows_of_the_requests_the_worker_does_not(tiny_model_dir):
    scheduler = _ours(tiny_model_dir)
    listed, _ = _add(scheduler, "list"), _add(scheduler, "tree")
    output = _step_output(["list", "tree"])
    setattr(output, WORKER_ROWS_ATTR, ["tree"])
    grammar_output = scheduler.get_grammar_bitmask(output)
    assert grammar_output.structured_output_request_ids == ["list"]
    rows = torch.from_numpy(grammar_output.grammar_bitmask)
    assert rows.shape[0] == K + 1
    assert torch.equal(rows[0], _path_row(scheduler, listed, []))
    assert grammar_output.num_acceptable_drafts == [0]  # placeholders: none acceptable


def _bitmask(scheduler, num_rows: int) -> torch.Tensor:
    return scheduler.structured_output_manager.backend.allocate_token_bitmask(num_rows)


def test_a_trees_rows_from_the_worker_equal_the_deferred_steps(tiny_model_dir, tokens):
    """The same tree, filled by the worker from the request's grammar and by
    the scheduler's deferred step: row for row, the same acceptable count,
    and the grammar rolled back."""
    scheduler = _ours(tiny_model_dir, False)
    request = _add(scheduler, "tree")
    output = _step_output(["tree"])
    scheduler.update_draft_token_ids_in_output(_drafts(["tree"], tokens, {"tree"}), output)
    deferred = scheduler.get_grammar_bitmask(output)
    rows = _bitmask(scheduler, K + 1)
    grammar = request.structured_output_request.grammar
    drafts = [tokens[c] for c in DRAFT_CHARS]
    assert fill_request_rows(grammar, "tree", rows, drafts, PARENTS) == K
    assert torch.equal(rows, torch.from_numpy(deferred.grammar_bitmask[:K + 1]))
    assert deferred.num_acceptable_drafts == [K]
    assert grammar.num_processed_tokens == 0


def test_a_chains_rows_hold_its_valid_prefix_on_its_path_and_forbid_the_rest(
        tiny_model_dir, tokens):
    """Drafts "a b c a" as a chain: "a b" valid ("abd"), "c" not. Rows 0-2
    in the states after "", "a", "a b"; the invalid "c" gets "a b"'s row,
    which forbids it, so all K stay acceptable and none past "a b" is
    ever accepted (vLLM's deferred step cuts the list there instead)."""
    scheduler = _ours(tiny_model_dir, False)
    request = _add(scheduler, "chain")
    a, b, c = tokens["a"], tokens["b"], tokens["c"]
    rows = _bitmask(scheduler, K + 1)
    grammar = request.structured_output_request.grammar
    assert fill_request_rows(grammar, "chain", rows, [a, b, c, a], None) == K
    for node, path in ((0, []), (1, [a]), (2, [a, b])):
        assert torch.equal(rows[node], _path_row(scheduler, request, path))
    assert torch.equal(rows[3], rows[2]) and torch.equal(rows[4], rows[2])
    assert not (int(rows[2][c // 32]) >> (c % 32)) & 1
    assert grammar.num_processed_tokens == 0


def test_drafts_the_worker_does_not_know_get_the_roots_row_and_none_is_acceptable(
        tiny_model_dir, tokens):
    scheduler = _ours(tiny_model_dir, False)
    request = _add(scheduler, "unknown")
    rows = _bitmask(scheduler, K + 1)
    grammar = request.structured_output_request.grammar
    root = _path_row(scheduler, request, [])
    # none; fewer than the slots; vLLM's placeholders (a batch it copied none of)
    for drafts in (None, [tokens["a"]] * (K - 1), [-1] * K):
        rows.zero_()
        assert fill_request_rows(grammar, "unknown", rows, drafts, None) == 0
        assert all(torch.equal(row, root) for row in rows)


def test_a_terminated_grammars_rows_allow_everything_as_vllms(tiny_model_dir, tokens):
    scheduler = _ours(tiny_model_dir, False)
    request = _add(scheduler, "done")
    grammar = request.structured_output_request.grammar
    assert grammar.accept_tokens("done", [tokens["b"], tokens["c"]])
    stop = grammar.matcher.stop_token_ids[0]
    assert grammar.accept_tokens("done", [stop]) and grammar.is_terminated()
    rows = _bitmask(scheduler, 3)
    rows.zero_()
    fill_request_rows(grammar, "done", rows, [tokens["a"], tokens["b"]], None)
    assert bool((rows == -1).all())


def test_merged_rows_keep_the_schedulers_first_and_map_by_ids():
    from vllm.v1.core.sched.output import GrammarOutput

    theirs = GrammarOutput(["x"], np.full((2, 3), 7, dtype=np.int32), [1])
    ours = np.full((3, 3), 9, dtype=np.int32)
    merged = merged_grammar_output(theirs, ["y"], ours, [2])
    assert merged.structured_output_request_ids == ["x", "y"]
    assert merged.grammar_bitmask[:2].tolist() == [[7] * 3] * 2
    assert merged.grammar_bitmask[2:].tolist() == [[9] * 3] * 3
    assert merged.num_acceptable_drafts == [1, 2]
    alone = merged_grammar_output(None, ["y"], ours, [2])
    assert alone.structured_output_request_ids == ["y"] and alone.num_acceptable_drafts == [2]
    # an older scheduler's None: none of its drafts acceptable, ours still
    older = merged_grammar_output(GrammarOutput(["x"], theirs.grammar_bitmask), ["y"], ours, [2])
    assert older.num_acceptable_drafts == [0, 2]


def test_rows_go_to_the_worker_only_where_every_condition_holds(tiny_model_dir,
                                                               tiny_eagle3_dir, monkeypatch):
    """Our tree methods with `grammar_rows` "worker" (the default), Model
    Runner V2, async scheduling, a scheduler that hands the rows over, and
    no reasoning parser."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_specplug.integration.config import ProposerSelection, attach

    config = _scheduler(SpecplugTreeAsyncScheduler, tiny_model_dir).vllm_config
    on_v2 = {"v2": True}  # vLLM decides it from the platform: CPU is the V1 runner
    monkeypatch.setattr(type(config), "use_v2_model_runner",
                        property(lambda self: on_v2["v2"]))

    def verdict(grammar_rows=None, method="specplug_eagle3", v2=True, async_=True,
                scheduler_cls=SpecplugTreeAsyncScheduler, reasoning=""):
        options = {"model": str(tiny_eagle3_dir), "topk": 4, "num_steps": 4}
        if grammar_rows is not None:
            options["grammar_rows"] = grammar_rows
        if method == "specplug_ngram":
            options = {}
        attach(config.speculative_config, ProposerSelection(method, json.dumps(options)))
        on_v2["v2"] = v2
        config.scheduler_config.async_scheduling = async_
        config.scheduler_config.scheduler_cls = scheduler_cls
        config.structured_outputs_config.reasoning_parser = reasoning
        return rows_in_worker(config)

    assert verdict("worker") and verdict()
    assert not verdict("scheduler")
    assert not verdict(method="specplug_ngram")
    assert not verdict(v2=False)
    assert not verdict(async_=False)
    assert not verdict(scheduler_cls=AsyncScheduler)
    assert not verdict(reasoning="deepseek_r1")


def test_a_bad_grammar_rows_value_names_the_field_and_the_choices(tiny_eagle3_dir):
    from vllm_specplug.proposers.base import ProposerConfigError
    from vllm_specplug.proposers.eagle3 import Eagle3TreeOptions

    with pytest.raises(ProposerConfigError, match="grammar_rows='engine'.*worker, scheduler"):
        Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": str(tiny_eagle3_dir),
                                                        "grammar_rows": "engine"})


# ---- the worker's side on Model Runner V2's stand-ins ----------------------

# root "b" sampled after the prompt; under it "c" ("bc": valid) and "a"
# (invalid), "d" under "c" (invalid: "bcd"), "b" under "a" (under an invalid node)
ROOT_CHAR, WORKER_DRAFT_CHARS, WORKER_PARENTS = "b", "cadb", [-1, 0, 0, 1, 2]


def _speculator(tiny_model_dir, tokens):
    """`SpecplugV2HeadSpeculator`'s fields that `verification_rows` reads:
    requests "tree" (the regex) and "free" in slots 0 and 1 (batch rows 1
    and 0), "b" sampled after each prompt, and the drafts and parents as
    vLLM's handler and `GrammarParents` hand them over."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.outputs import DraftTokenIds

    from vllm_specplug.integration.grammar_trees import TREE_PARENTS_ATTR
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    from vllm_specplug.integration.v2.speculator import SpeculatorStats
    from vllm_specplug.integration.v2.structured import StructuredRequests

    config = _scheduler(SpecplugTreeAsyncScheduler, tiny_model_dir).vllm_config
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="abd|bc"))
    params.structured_outputs._backend = "xgrammar"
    structured = StructuredRequests(config)
    structured.schedule(SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[
        SimpleNamespace(req_id="tree", sampling_params=params),
        SimpleNamespace(req_id="free", sampling_params=SamplingParams())]))
    all_token_ids = torch.zeros(2, 32, dtype=torch.int64)
    all_token_ids[:, :len(PROMPT)] = torch.tensor(PROMPT)
    all_token_ids[:, len(PROMPT)] = tokens[ROOT_CHAR]
    req_states = SimpleNamespace(
        total_len=SimpleNamespace(gpu=torch.tensor([len(PROMPT) + 1] * 2)),
        prompt_len=SimpleNamespace(np=np.array([len(PROMPT)] * 2)),
        all_token_ids=SimpleNamespace(gpu=all_token_ids))
    drafts = DraftTokenIds(["tree", "free"], [[tokens[c] for c in WORKER_DRAFT_CHARS]] * 2)
    setattr(drafts, TREE_PARENTS_ATTR, {"tree": WORKER_PARENTS, "free": WORKER_PARENTS})
    input_batch = SimpleNamespace(req_ids=["free", "tree"], num_reqs=2,
                                  idx_mapping_np=np.array([1, 0]),
                                  num_draft_tokens_per_req=np.array([K, K]),
                                  cu_num_logits_np=np.array([0, K + 1, 2 * (K + 1)]))
    runner = SimpleNamespace(execute_model_state=SimpleNamespace(input_batch=input_batch),
                             take_draft_token_ids=lambda: drafts)
    speculator = SimpleNamespace(structured=structured, req_states=req_states,
                                 tree_slots=object(), stats=SpeculatorStats("cpu"),
                                 worker_rows_req_ids=["tree"], row_depth=None,
                                 tree_rows=None, row_threads=RowThreads(1),
                                 grammar_choices=None, choices_min_trees=None)
    for name in ("verification_rows", "_verification_rows", "_fill_rows"):
        setattr(speculator, name, MethodType(getattr(SpecplugV2HeadSpeculator, name), speculator))
    return speculator, runner


def _worker_grammar(speculator):
    return speculator.structured.grammars.tracked["tree"].holder \
        .structured_output_request.grammar


def _assert_rows_of_the_worker_tree(rows: torch.Tensor, grammar, tokens) -> None:
    """Rows after "b" (root), "b c" (node 1), copies of the nearest valid
    ancestor's for the invalid nodes."""
    expected = _bitmask_after(grammar, [[], [tokens["c"]]])
    assert torch.equal(rows[0], expected[0]) and torch.equal(rows[1], expected[1])
    assert not torch.equal(expected[0], expected[1])
    assert torch.equal(rows[2], rows[0])  # "a": invalid after "b"
    assert torch.equal(rows[3], rows[1])  # "d" under "c": invalid after "b c"
    assert torch.equal(rows[4], rows[0])  # under "a"
    for row, char in ((0, "a"), (1, "d")):
        token = tokens[char]
        assert not (int(rows[row][token // 32]) >> (token % 32)) & 1


def test_the_worker_fills_its_requests_rows_from_its_grammar_and_the_last_drafts(
        tiny_model_dir, tokens):
    """No drafting pass advanced the grammar: the worker reads the request's
    output ("b") from the device, then fills each node's row on its own
    path; the free request gets no row."""
    speculator, runner = _speculator(tiny_model_dir, tokens)
    grammar_output = speculator.verification_rows(runner, None)
    assert grammar_output.structured_output_request_ids == ["tree"]
    assert grammar_output.num_acceptable_drafts == [K]
    rows = torch.from_numpy(grammar_output.grammar_bitmask)
    assert rows.shape[0] == K + 1
    grammar = _worker_grammar(speculator)
    assert grammar.num_processed_tokens == 1  # advanced to "b"; the walk rolled back
    _assert_rows_of_the_worker_tree(rows, grammar, tokens)
    assert speculator.stats.worker_rows.tolist() == [1, 1, 1, 0]  # read from the device
    # the list is used once: the next step names nobody, rows stay the scheduler's
    assert speculator.verification_rows(runner, "theirs") == "theirs"


def test_a_grammar_the_drafting_pass_advanced_is_not_read_again(tiny_model_dir, tokens):
    """After the drafting pass of the step before read the outputs (for
    the first step's masks, `root_bitmask`), the rows need no read of the device: the stand-in's
    outputs are then broken on purpose, and the rows are still right. A
    drafting step that began without a read makes them stale again."""
    speculator, runner = _speculator(tiny_model_dir, tokens)
    structured, states = speculator.structured, speculator.req_states
    structured.grammar("tree", np.zeros(0, dtype=np.int64))  # its compile starts
    holder = structured.grammars.tracked["tree"].holder.structured_output_request
    holder._grammar.result(timeout=60)  # a drafting pass during the compile reads nothing
    structured.begin_step()
    structured.root_bitmask(SimpleNamespace(req_ids=["tree"], num_reqs=1,
                                            idx_mapping_np=np.array([0])), states)
    states.total_len.gpu = None  # a read now fails
    grammar_output = speculator.verification_rows(runner, None)
    _assert_rows_of_the_worker_tree(torch.from_numpy(grammar_output.grammar_bitmask),
                                    _worker_grammar(speculator), tokens)
    structured.begin_step()
    speculator.worker_rows_req_ids = ["tree"]
    with pytest.raises(TypeError):  # it reads the device
        speculator.verification_rows(runner, None)


def _drafting_batch():
    """The drafting pass's batch: "free" and "tree" decoding (slots 1 and
    0), each with K drafts verified and the sample after them to come."""
    return SimpleNamespace(req_ids=["free", "tree"], num_reqs=2, idx_mapping_np=np.array([1, 0]),
                           idx_mapping=torch.tensor([1, 0]),
                           seq_lens_cpu_upper_bound=np.array([len(PROMPT) + K] * 2))


def test_outputs_the_drafting_pass_queued_are_what_the_rows_read(tiny_model_dir, tokens):
    """With nothing masked in the drafting pass, it only queues a copy of
    the batch's outputs (`queue_outputs`): the rows of the next step read
    that copy, not the device (its stand-in broken after the copy), and a
    copy from an older drafting step is not used."""
    speculator, runner = _speculator(tiny_model_dir, tokens)
    structured, states = speculator.structured, speculator.req_states
    structured.begin_step()
    structured.queue_outputs(_drafting_batch(), states)
    states.total_len.gpu = None  # a read now fails
    grammar_output = speculator.verification_rows(runner, None)
    _assert_rows_of_the_worker_tree(torch.from_numpy(grammar_output.grammar_bitmask),
                                    _worker_grammar(speculator), tokens)
    assert speculator.stats.worker_rows.tolist() == [1, 1, 0, 0]
    structured.begin_step()
    speculator.worker_rows_req_ids = ["tree"]
    with pytest.raises(TypeError):  # the copy is the step before's: it reads the device
        speculator.verification_rows(runner, None)


def test_an_output_past_the_copied_width_is_read_from_the_device(tiny_model_dir, tokens):
    """The copy holds the columns the step could have written; an output
    that ends past them (a bound the host got wrong) is not cut short but
    read from the device, and the rows are still the right ones."""
    speculator, runner = _speculator(tiny_model_dir, tokens)
    structured, states = speculator.structured, speculator.req_states
    batch = _drafting_batch()
    batch.seq_lens_cpu_upper_bound = np.array([len(PROMPT) - 1] * 2)  # width: the prompt
    structured.begin_step()
    structured.queue_outputs(batch, states)
    assert structured.queued.width == len(PROMPT)
    grammar_output = speculator.verification_rows(runner, None)
    _assert_rows_of_the_worker_tree(torch.from_numpy(grammar_output.grammar_bitmask),
                                    _worker_grammar(speculator), tokens)
    assert speculator.stats.worker_rows.tolist() == [1, 1, 1, 0]


def test_a_tree_whose_parents_did_not_come_gets_no_acceptable_draft(tiny_model_dir, tokens):
    """Drafts without their tree's parents cannot be read as a tree (nor
    as a chain): the root's row for every slot, none acceptable."""
    from vllm_specplug.integration.grammar_trees import TREE_PARENTS_ATTR

    speculator, runner = _speculator(tiny_model_dir, tokens)
    setattr(runner.take_draft_token_ids(), TREE_PARENTS_ATTR, {})
    grammar_output = speculator.verification_rows(runner, None)
    assert grammar_output.num_acceptable_drafts == [0]
    rows = torch.from_numpy(grammar_output.grammar_bitmask)
    assert all(torch.equal(row, rows[0]) for row in rows)
    assert speculator.stats.worker_rows.tolist() == [1, 0, 1, K]  # no draft's row filled


def _bitmask_after(grammar, paths: list[list[int]]) -> torch.Tensor:
    """The rows of `grammar` after each path from its current state."""
    import xgrammar as xgr

    rows = xgr.allocate_token_bitmask(len(paths), 4096)
    for row, path in enumerate(paths):
        if path:
            assert grammar.accept_tokens("probe", path)
        grammar.fill_bitmask(rows, row)
        if path:
            grammar.rollback(len(path))
    return rows
