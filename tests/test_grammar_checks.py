"""The worker-grammar checks of the GPU grammar tests
(vllm_specplug/testing/grammar_checks.py), on CPU over the worker-rows
stand-in of tests/test_worker_rows.py (the regex "abd|bc", "b" sampled):
a grammar in its output's state passes at verification and in a drafting
pass; one advanced a token past its output is recorded with its request,
the step's way and its counts; the patched classes are restored after."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
from vllm_specplug.integration.v2.structured import StructuredRequests
from vllm_specplug.testing.grammar_checks import worker_grammar_checks

from tests.test_worker_rows import _speculator, _worker_grammar, tokens

__all__ = ["tokens"]  # a fixture


def test_a_grammar_in_its_outputs_state_passes_every_check(tiny_model_dir, tokens):
    with worker_grammar_checks() as checks:
        speculator, runner = _speculator(tiny_model_dir, tokens)
        speculator.verification_rows(runner, None)
        speculator.structured.begin_step()
        speculator.structured.root_bitmask(SimpleNamespace(
            req_ids=["tree"], num_reqs=1, idx_mapping_np=np.array([0])), speculator.req_states)
    assert checks.num_checks == {"verify": 1, "draft": 1}
    assert checks.mismatches == []
    assert checks.events[0]["way"] == "rows" and checks.events[0]["req_ids"] == ["tree"]


def test_a_grammar_a_token_past_its_output_is_recorded(tiny_model_dir, tokens):
    before = (StructuredRequests.__dict__["verifying_grammars"],
              SpecplugV2HeadSpeculator._verification_rows)
    with worker_grammar_checks() as checks:
        speculator, runner = _speculator(tiny_model_dir, tokens)
        speculator.verification_rows(runner, None)  # the grammar advanced to "b"
        _worker_grammar(speculator).accept_tokens("tree", [tokens["c"]])  # "b c": one past
        speculator.worker_rows_req_ids = ["tree"]
        speculator.structured.begin_step()
        speculator.structured.last_read = (speculator.structured.step, frozenset({"tree"}))
        speculator.verification_rows(runner, None)
    [mismatch] = checks.mismatches
    assert (mismatch["where"], mismatch["req_id"], mismatch["way"]) == ("verify", "tree", "rows")
    assert (mismatch["num_processed"], mismatch["output_len"]) == (2, 1)
    assert (StructuredRequests.__dict__["verifying_grammars"],
            SpecplugV2HeadSpeculator._verification_rows) == before  # restored
