"""A faulty proposer must never take the engine down (issue 14): the unit
half, with stand-ins. Plain-Python tests of the draft checks, the option, the
guard and the real `SpecplugDrafter` driven by a fake V1 model runner
(`tests/proposer_plugins/faulty.py::FakeRunner`) cover every fault kind
quickly; `test_fault_isolation.py` runs the same faults in real engines.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.integration.config import translate
from vllm_specplug.integration.guard import (DEFAULT_MAX_PROPOSER_FAILURES,
                                             InvalidDraftError, ProposerGuard, check_draft,
                                             check_drafts)
from vllm_specplug.proposers.base import ProposeBatch, ProposerConfigError, ProposerContext
from vllm_specplug.proposers.hybrid import HybridOptions, HybridProposer
from vllm_specplug.proposers.ngram import NgramOptions, NgramProposer
from vllm_specplug.proposers.suffix import SuffixOptions, SuffixProposer

from tests.proposer_plugins.faulty import OUT_OF_VOCAB, FakeRunner, make_drafter

VOCAB = 32  # the fake runner's
K = 3


pytestmark = pytest.mark.usefixtures("faulty_entry_point")


# ---------------------------------------------------------------- draft checks

VALID = [([], []), ([0, 5, VOCAB - 1], [0, 5, VOCAB - 1]), ((4, 5), [4, 5]),
         ([np.int32(3), np.int64(4)], [3, 4]), (np.array([1, 2], dtype=np.int32), [1, 2]),
         (np.array([], dtype=np.int64), []), (np.array([7], dtype=np.uint8), [7]),
         (torch.tensor([6, 7, 8]), [6, 7, 8])]
INVALID = {
    "out_of_vocab": [[OUT_OF_VOCAB], [VOCAB], [1, -1], np.array([2, VOCAB + 3]),
                     torch.tensor([-5])],
    "too_long": [[1, 2, 3, 4], np.arange(K + 1)],
    "draft_type": [[True, False], np.array([True]), torch.tensor([True]), [1.0, 2.0],
                   np.array([1.0]), torch.tensor([1.0]), ["1", "2"], "12", b"\x01", None, 3,
                   {1: 2}, [[1, 2]], np.array([[1, 2]]), [1, None], iter([1, 2])]}


@pytest.mark.parametrize("draft,expected", VALID)
def test_valid_drafts_become_python_int_lists(draft, expected):
    ids = check_draft(draft, K, VOCAB)
    assert ids == expected and all(type(t) is int for t in ids)


@pytest.mark.parametrize("draft,kind", [(d, kind) for kind, ds in INVALID.items() for d in ds])
def test_invalid_drafts_are_rejected_by_kind(draft, kind):
    with pytest.raises(InvalidDraftError) as info:
        check_draft(draft, K, VOCAB)
    assert info.value.kind == kind


def test_exactly_k_tokens_pass_and_the_allowance_is_per_step():
    assert check_draft([1, 2, 3], 3, VOCAB) == [1, 2, 3]
    with pytest.raises(InvalidDraftError, match="at most 2 are allowed"):
        check_draft([1, 2, 3], 2, VOCAB)
    with pytest.raises(InvalidDraftError, match="at most 0"):
        check_draft([1], 0, VOCAB)


@pytest.mark.parametrize("drafts,kind", [
    (None, "draft_list"), ({"a": [1]}, "draft_list"), (np.zeros((2, 1)), "draft_list"),
    ([[1]], "draft_count"), ([[1], [2], [3]], "draft_count"), ([], "draft_count"),
])
def test_the_list_of_drafts_needs_one_per_request(drafts, kind):
    with pytest.raises(InvalidDraftError) as info:
        check_drafts(drafts, 2)
    assert info.value.kind == kind


def test_a_tuple_of_drafts_is_accepted():
    assert check_drafts(([1], []), 2) == [[1], []]


# ------------------------------------------------------------- the new option

@pytest.mark.parametrize("method,extra", [
    ("specplug_ngram", {}), ("specplug_suffix", {}), ("test_faulty", {"fault": "none"}),
    ("specplug_hybrid", {"proposers": [{"method": "specplug_ngram"}]}),
])
def test_max_proposer_failures_is_accepted_for_every_method(method, extra):
    base = {"method": method, "num_speculative_tokens": 2, **extra}
    vllm_dict, selection = translate({**base, "max_proposer_failures": 0})
    assert selection.max_proposer_failures == 0
    assert "max_proposer_failures" not in vllm_dict and "max_proposer_failures" not in (
        selection.options)
    assert translate(base)[1].max_proposer_failures == DEFAULT_MAX_PROPOSER_FAILURES


@pytest.mark.parametrize("value", [-1, 1.5, "3", True, [3]])
def test_max_proposer_failures_must_be_an_int_at_least_0(value):
    with pytest.raises(ProposerConfigError,
                       match=r"'specplug_ngram'.*max_proposer_failures=.* must be an int >= 0"):
        translate({"method": "specplug_ngram", "num_speculative_tokens": 2,
                   "max_proposer_failures": value})


def test_faulty_proposer_options_are_validated():
    with pytest.raises(ProposerConfigError, match="fault='nope' must be one of"):
        translate({"method": "test_faulty", "num_speculative_tokens": 2, "fault": "nope"})


# ------------------------------------------------------------------ the guard

def raise_(exc_type, *args):
    raise exc_type(*args)


def drafter_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "vllm_specplug.drafter"
            and r.levelno == logging.ERROR]


def test_guard_logs_each_kind_once_with_traceback_and_counts_all(caplog):
    guard = ProposerGuard("m", max_failures=10)
    assert guard.call("propose", ["b", "a"], lambda: 5) == (True, 5)
    for i in range(3):
        assert guard.call("propose", ["b", "a"], raise_, KeyError, i) == (False, None)
    guard.record("propose:out_of_vocab", "propose", ["c"], "draft token id 99")
    assert guard.failure_counts == {"propose:KeyError": 3, "propose:out_of_vocab": 1}
    records = drafter_records(caplog)
    assert len(records) == 2
    assert records[0].getMessage().startswith(
        "vllm-specplug proposer 'm' failed in propose (KeyError: 0) for request(s) "
        "['a', 'b']")
    assert records[0].exc_info and records[0].exc_info[0] is KeyError
    assert "draft token id 99" in records[1].getMessage() and not records[1].exc_info
    assert not guard.disabled


def test_guard_lets_base_exceptions_through():
    with pytest.raises(KeyboardInterrupt):
        ProposerGuard("m", 1).call("propose", [], raise_, KeyboardInterrupt)


@pytest.mark.parametrize("max_failures", [0, 1, 4])
def test_guard_switches_off_after_max_failures_and_says_so_once(caplog, max_failures):
    guard = ProposerGuard("m", max_failures)
    for _ in range(max_failures):
        guard.record("propose:x", "propose", ["a"], "bad")
        assert not guard.disabled
    guard.record("propose:x", "propose", ["a"], "bad")
    assert guard.disabled
    guard.record("propose:y", "propose", ["a"], "bad")
    off = [r for r in drafter_records(caplog) if "SWITCHED OFF" in r.getMessage()]
    assert len(off) == 1
    assert f"after {max_failures + 1} failures (max_proposer_failures={max_failures})" in (
        off[0].getMessage())


# ------------------------------------------- the drafter, with a fake runner

def test_healthy_proposer_drafts_through_the_guard():
    drafter, runner = make_drafter({}), FakeRunner(3)
    for _ in range(4):
        drafts = runner.step(drafter)
    assert all(len(d) == K for d in drafts)
    assert drafter.failure_counts == {} and drafter.quarantined == set()


DRAFT_FAULT_KINDS = {"out_of_vocab": "out_of_vocab", "negative": "out_of_vocab",
                     "too_many": "too_long", "strings": "draft_type", "floats": "draft_type",
                     "none": "draft_list", "wrong_count": "draft_count",
                     "write_history": "ValueError", "propose_raises": "RuntimeError"}


@pytest.mark.parametrize("fault,kind", list(DRAFT_FAULT_KINDS.items()))
def test_faulty_propose_costs_only_that_steps_drafts(caplog, fault, kind):
    drafter, runner = make_drafter({"fault": fault, "after": 2, "times": 2}), FakeRunner(3)
    for step in range(6):
        drafts = runner.step(drafter)
        if step in (2, 3):
            assert drafts == [[], [], []], fault
        else:
            assert all(len(d) == K for d in drafts), (fault, step)
    assert drafter.failure_counts == {f"propose:{kind}": 2}
    assert not drafter.guard.disabled
    records = drafter_records(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert message.startswith("vllm-specplug proposer 'test_faulty' failed in propose (")
    assert "for request(s) ['req-0', 'req-1', 'req-2']" in message
    assert bool(records[0].exc_info) == (kind in ("ValueError", "RuntimeError"))


def wrap_propose(drafter, then) -> None:
    """The drafter's proposer returns `then(batch, its drafts)`."""
    original = drafter.proposer.propose
    drafter.proposer.propose = lambda batch: then(batch, original(batch))


def test_one_bad_draft_costs_only_its_request():
    drafter, runner = make_drafter({}), FakeRunner(3)
    wrap_propose(drafter, lambda batch, drafts: [drafts[0], [OUT_OF_VOCAB], drafts[2]])
    assert [len(d) for d in runner.step(drafter)] == [K, 0, K]
    assert drafter.failure_counts == {"propose:out_of_vocab": 1}


def test_history_buffer_is_read_only_for_the_proposer():
    drafter, runner, seen = make_drafter({}), FakeRunner(3), []
    wrap_propose(drafter, lambda batch, drafts: seen.append(batch) or drafts)
    runner.step(drafter)
    with pytest.raises(ValueError, match="read-only"):
        seen[0].token_ids[0, 0] = 99
    with pytest.raises(ValueError, match="read-only"):
        seen[0].num_tokens[0] = 1


@pytest.mark.parametrize("fault,method", [("start_raises", "start_request"),
                                          ("update_raises", "update_request")])
def test_failed_lifecycle_call_quarantines_the_request_until_removed(caplog, fault, method):
    # after=1: the second request's call fails (start: first step; update: first step's
    # history update of a new request is that request's first update call).
    drafter, runner = make_drafter({"fault": fault, "after": 1, "times": 1}), FakeRunner(3)
    for _ in range(3):
        drafts = runner.step(drafter)
        assert [len(d) for d in drafts] == [K, 0, K]
    assert drafter.quarantined == {"req-1"}
    assert drafter.failure_counts == {f"{method}:ProposerFault": 1}
    message = drafter_records(caplog)[0].getMessage()
    assert f"failed in {method} (ProposerFault: {method} fault for req-1)" in message
    assert "for request(s) ['req-1']; no drafts for it until it leaves the batch" in message
    calls_before = dict(drafter.proposer.calls)
    runner.step(drafter)
    # a quarantined request gets no lifecycle calls either
    assert drafter.proposer.calls["update_request"] - calls_before.get("update_request", 0) == 2
    runner.remove(drafter, 1)
    assert drafter.quarantined == set() and "req-1" not in drafter.active


def test_raising_stop_request_is_counted_and_forgets_the_request(caplog):
    drafter, runner = make_drafter({"fault": "stop_raises"}), FakeRunner(3)
    runner.step(drafter)
    runner.remove(drafter, 0)
    runner.remove(drafter, 0)  # a second removal calls nothing
    assert drafter.failure_counts == {"stop_request:ProposerFault": 1}
    assert "req-0" not in drafter.active
    assert "failed in stop_request" in drafter_records(caplog)[0].getMessage()
    assert all(len(d) == K for d in runner.step(drafter)[1:])


def test_preempted_request_leaves_quarantine_and_restarts():
    drafter, runner = make_drafter({"fault": "start_raises", "times": 1}), FakeRunner(3)
    runner.step(drafter)
    assert drafter.quarantined == {"req-0"}
    drafter._retire(SimpleNamespace(preempted_req_ids={"req-0"}))
    assert drafter.quarantined == set() and "req-0" not in drafter.active
    drafts = runner.step(drafter)  # started again, healthy this time
    assert all(len(d) == K for d in drafts)


@pytest.mark.parametrize("max_failures", [0, 2])
def test_proposer_is_switched_off_for_good_after_max_failures(caplog, max_failures):
    drafter = make_drafter({"fault": "propose_raises"}, max_failures=max_failures)
    runner = FakeRunner(3)
    for _ in range(max_failures + 1):
        assert runner.step(drafter) == [[], [], []]
    assert drafter.guard.disabled
    calls = dict(drafter.proposer.calls)
    for _ in range(3):
        assert runner.step(drafter) == [[], [], []]
    runner.remove(drafter, 0)
    assert dict(drafter.proposer.calls) == calls  # the proposer is never called again
    assert drafter.failure_counts == {"propose:RuntimeError": max_failures + 1}
    messages = [r.getMessage() for r in drafter_records(caplog)]
    assert sum("SWITCHED OFF" in m for m in messages) == 1
    assert sum("failed in propose" in m for m in messages) == 1


def test_drafts_are_still_cut_at_max_model_len():
    drafter, runner = make_drafter({}, max_model_len=10), FakeRunner(3)
    drafts = runner.step(drafter)  # 9 tokens: one more may be drafted
    assert [len(d) for d in drafts] == [1, 1, 1]
    assert drafter.failure_counts == {}


CONTEXT = ProposerContext(K, 256, VOCAB, "cpu")


@pytest.mark.parametrize("proposer", [
    NgramProposer(NgramOptions(), CONTEXT),
    SuffixProposer(SuffixOptions(min_token_prob=0.0), CONTEXT),
    HybridProposer(HybridOptions(proposers=[{"method": "specplug_suffix"},
                                            {"method": "specplug_ngram"}]), CONTEXT),
], ids=["ngram", "suffix", "hybrid"])
def test_builtin_proposers_work_on_a_read_only_history(proposer):
    history = np.array([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]], dtype=np.int32)
    proposer.start_request("a", history[0, :8].copy())
    proposer.update_request("a", [1, 2])
    history.setflags(write=False)
    num_tokens = np.array([10])
    num_tokens.setflags(write=False)
    drafts = proposer.propose(ProposeBatch(["a"], history, num_tokens, K))
    assert drafts == [[3, 4, 1]]


def test_bad_confidences_cost_the_confidences_not_the_drafts(caplog):
    """Confidences out of [0, 1] (or of the wrong length) are a recorded
    failure of the proposer; its drafts still go to the target."""
    from vllm_specplug.proposers.base import Drafts

    drafter, runner = make_drafter({}), FakeRunner(3)
    wrap_propose(drafter, lambda batch, drafts: Drafts(list(drafts),
                                                       [[2.0] * len(d) for d in drafts]))
    for _ in range(3):
        drafts = runner.step(drafter)
        assert all(len(d) == K for d in drafts)
    wrap_propose(drafter, lambda batch, drafts: Drafts(list(drafts), [None]))
    assert all(len(d) == K for d in runner.step(drafter))
    assert drafter.failure_counts == {"propose:confidences": 4}
    assert "drafts kept without confidences" in drafter_records(caplog)[0].getMessage()
