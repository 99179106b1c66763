"""A faulty proposer must never take the engine down (issue 14), in real
engines: `test_faulty`, a third-party proposer installed through the
entry-point group (tests/proposer_plugins/faulty.py), raises on its 4th
`propose` call in one engine and returns token id 10**6 until it is switched
off in another. Both must keep serving, token for token like no speculation;
their worker logs (a file handler set up by the proposer) and guard state (a
worker extension) are checked from outside. Every fault kind, with a fake
runner: `test_fault_isolation_unit.py`.
"""
from __future__ import annotations

import re

import pytest

from vllm_specplug.testing.engine import generate, greedy_params, running_llm
from vllm_specplug.testing.metrics import read_spec_decode_counts

from tests.conftest import MAX_NEW_TOKENS
from tests.proposer_plugins.faulty import OUT_OF_VOCAB, PROBE_QUALNAME

K = 3


pytestmark = pytest.mark.usefixtures("faulty_entry_point")


# ------------------------------------------------------------- real engines

ERROR_LINE = re.compile(r"^ERROR vllm_specplug\.drafter (.*)$", re.M)


def faulty_llm(model_dir, log_file, **options):
    """A real engine running `test_faulty` (one test each, so that only one
    faulty engine lives at a time)."""
    return running_llm(model_dir, {"method": "test_faulty", "num_speculative_tokens": K,
                                   "log_file": str(log_file), **options},
                       worker_extension_cls=PROBE_QUALNAME)


def fault_state(llm) -> dict:
    return llm.collective_rpc("specplug_fault_state")[0]


def check_serves_exactly(llm, eval_prompts, baseline_outputs, singles=(0, 7)):
    params = greedy_params(MAX_NEW_TOKENS)
    assert generate(llm, eval_prompts, params).token_ids == baseline_outputs["batched"]
    for i in singles:  # later requests, alone
        assert generate(llm, [eval_prompts[i]], params).token_ids == [
            baseline_outputs["single"][i]]


def test_engine_survives_propose_raising_and_keeps_speculating(
        tiny_model_dir, tmp_path, eval_prompts, baseline_outputs):
    """Issue 14's first fault: RuntimeError on the 4th propose call."""
    log_file = tmp_path / "worker.log"
    with faulty_llm(tiny_model_dir, log_file, fault="propose_raises", after=3,
                    times=1) as llm:
        check_serves_exactly(llm, eval_prompts, baseline_outputs)
        state = fault_state(llm)
        assert state["faults"] == 1 and state["calls"]["propose"] > 10
        assert state["failure_counts"] == {"propose:RuntimeError": 1}
        assert not state["disabled"] and state["quarantined"] == []
        # Speculation goes on after the fault: drafts are still accepted.
        before = read_spec_decode_counts(llm)
        check_serves_exactly(llm, eval_prompts, baseline_outputs, singles=(3,))
        assert (read_spec_decode_counts(llm) - before).num_accepted_tokens > 0
    assert ERROR_LINE.findall(log_file.read_text()) == [
        "vllm-specplug proposer 'test_faulty' failed in propose (RuntimeError: propose "
        f"fault on call 4) for request(s) {sorted(state['fault_req_ids'][0])}; no drafts "
        "for them this step (failure 1, max_proposer_failures=8; later "
        "'propose:RuntimeError' failures are counted, not logged)"]
    assert "Traceback" in log_file.read_text()


def test_engine_survives_out_of_vocab_drafts_and_switches_the_proposer_off(
        tiny_model_dir, tmp_path, eval_prompts, baseline_outputs):
    """Issue 14's second fault: token id 10**6, from the 3rd propose call on,
    switched off after max_proposer_failures=4 (the 5th bad step)."""
    log_file = tmp_path / "worker.log"
    with faulty_llm(tiny_model_dir, log_file, fault="out_of_vocab", after=2,
                    max_proposer_failures=4) as llm:
        check_serves_exactly(llm, eval_prompts, baseline_outputs)
        state = fault_state(llm)
        assert state["disabled"] and state["faults"] == 5 and state["calls"]["propose"] == 7
        assert state["failure_counts"] == {"propose:out_of_vocab": 5}
        before = read_spec_decode_counts(llm)
        check_serves_exactly(llm, eval_prompts, baseline_outputs, singles=(5,))
        assert fault_state(llm)["calls"] == state["calls"]  # never called again
        assert (read_spec_decode_counts(llm) - before).num_draft_tokens == 0
    errors = ERROR_LINE.findall(log_file.read_text())
    assert len(errors) == 2
    assert errors[0].startswith("vllm-specplug proposer 'test_faulty' failed in propose "
                                f"(draft token id {OUT_OF_VOCAB} is outside [0, ")
    assert errors[1] == (
        "vllm-specplug proposer 'test_faulty' SWITCHED OFF for the engine's life after 5 "
        "failures (max_proposer_failures=4): {'propose:out_of_vocab': 5}; generation goes "
        "on without speculation")
