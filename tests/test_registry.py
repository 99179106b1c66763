"""The proposer registry: entry points, option validation with named errors,
and a proposer defined only in this test suite selected by name in a real
engine, whose lifecycle calls are checked from outside the worker."""
from __future__ import annotations

import json
import sys

import pytest

from vllm_specplug import registry
from vllm_specplug.integration.config import translate
from vllm_specplug.proposers.base import ProposerConfigError
from vllm_specplug.testing.engine import (generate, generate_with_abort, greedy_params,
                                          make_llm, shutdown_llm)

from tests.proposer_plugins.recording import ENTRY_POINT


def test_builtins_register_through_entry_points():
    assert {"specplug_ngram", "specplug_suffix", "specplug_hybrid"} <= set(
        registry.available_proposers())


@pytest.mark.parametrize("config,message", [
    ({"method": "specplug_nope", "num_speculative_tokens": 2},
     r"method='specplug_nope' is unknown; vllm-specplug proposers: \[.*'specplug_ngram'"),
    ({"method": "specplug_ngram"}, r"num_speculative_tokens is required"),
    ({"method": "specplug_ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "4"},
     r"prompt_lookup_max='4' must be int"),
    ({"method": "specplug_ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     r"prompt_lookup_min=0 must be >= 1"),
    ({"method": "specplug_ngram", "num_speculative_tokens": 2, "lookup": 3},
     r"unknown option\(s\) \['lookup'\]; accepted: \['prompt_lookup_max', 'prompt_lookup_min'\]"),
    ({"method": "specplug_suffix", "num_speculative_tokens": 2, "min_token_prob": 1.5},
     r"min_token_prob=1.5 must be in \[0, 1\]"),
    ({"method": "specplug_hybrid", "num_speculative_tokens": 2, "proposers": [{"method": "x"}]},
     r"specplug_hybrid.proposers\[0\]: .*method 'x'"),
    ({"method": "specplug_ngram", "num_speculative_tokens": 2, "model": "m"},
     r"'model' is not accepted"),
    # issue 29: a draft sharded over ranks is refused, not run replicated in silence
    ({"method": "specplug_ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     r"draft_tensor_parallel_size=2 is not supported: .* Remove draft_tensor_parallel_size "
     r"or set it to 1"),
    ({"method": "specplug_mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 4},
     r"'specplug_mtp': draft_tensor_parallel_size=4 is not supported"),
])
def test_bad_config_names_the_field(config, message):
    with pytest.raises(ProposerConfigError, match=message):
        translate(config)


def test_draft_tensor_parallel_size_one_is_accepted():
    vllm_config, _ = translate({"method": "specplug_ngram", "num_speculative_tokens": 2,
                                "draft_tensor_parallel_size": 1})
    assert vllm_config["draft_tensor_parallel_size"] == 1


def test_engine_refuses_unknown_method_with_our_list(tiny_model_dir):
    with pytest.raises(Exception, match=r"vllm-specplug proposers: \["):
        make_llm(tiny_model_dir, {"method": "specplug_typo", "num_speculative_tokens": 2})


def _install_entry_points(site, lines: str) -> None:
    """A dist-info on sys.path declaring `lines` in our entry-point group."""
    dist = site / "specplug_test_plugins-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: specplug-test-plugins\n"
                                   "Version: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm_specplug.proposers]\n{lines}\n")
    sys.path.insert(0, str(site))
    registry.refresh()


def test_a_third_party_cannot_shadow_vllms_methods(tmp_path, caplog):
    _install_entry_points(tmp_path, "ngram = tests.proposer_plugins.recording:"
                          "RecordingProposer\nthird_ok = tests.proposer_plugins.recording:"
                          "RecordingProposer")
    try:
        assert "ngram" in registry.vllm_method_names()
        assert not registry.is_registered("ngram")       # vLLM's ngram stays vLLM's
        assert registry.is_registered("third_ok")        # the rest of the package loads
        assert translate({"method": "ngram", "num_speculative_tokens": 2}) is None
        with pytest.raises(registry.ShadowingProposerError,
                           match=r"proposers:ngram = .* is refused: 'ngram' is one of "
                                 r"vLLM's own .* another name \(e.g. 'mypkg_ngram'\)"):
            registry.get_proposer_class("ngram")
        assert "is refused" in caplog.text                # logged where it is read
        assert set(registry.refused_proposers()) == {"ngram"}
    finally:
        sys.path.remove(str(tmp_path))
        registry.refresh()
    assert registry.refused_proposers() == {}


@pytest.fixture(scope="module")
def recording_llm(tiny_model_dir, tmp_path_factory):
    """Install the test-only entry point (a dist-info on sys.path, visible to
    the engine's processes, which inherit sys.path) and start an engine."""
    site = tmp_path_factory.mktemp("site")
    _install_entry_points(site, ENTRY_POINT)
    log_path = tmp_path_factory.mktemp("log") / "events.jsonl"
    llm = make_llm(tiny_model_dir, {"method": "test_recording", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 3, "log_path": str(log_path)})
    yield llm, log_path
    shutdown_llm(llm)
    sys.path.remove(str(site))
    registry.refresh()


def read_events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_test_only_proposer_runs_with_full_lifecycle(recording_llm, baseline_llm, eval_prompts):
    llm, log_path = recording_llm
    prompts = eval_prompts[:3]
    params = greedy_params(24)
    produced = generate_with_abort(llm, prompts, params, abort_index=2, abort_after_steps=4)
    generate(llm, [eval_prompts[5]], greedy_params(4))  # a later step retires them
    events = read_events(log_path)
    expected = generate(baseline_llm, prompts, params).token_ids
    assert [produced[str(i)] for i in (0, 1)] == expected[:2]
    assert len(produced["2"]) < len(expected[2])  # really aborted
    by_req: dict[str, list[dict]] = {}
    for event in events:
        if "req_id" in event:
            by_req.setdefault(event["req_id"], []).append(event)
    # vLLM gives requests internal ids; match them to prompts by their tokens.
    tokenizer = llm.get_tokenizer()
    internal = {tuple(events_[0]["prompt"]): req_id for req_id, events_ in by_req.items()
                if events_[0]["event"] == "start"}
    for i in range(3):
        req_id = internal[tuple(tokenizer(prompts[i]).input_ids)]
        req_events = by_req[req_id]
        assert req_events[-1] == {"event": "stop", "req_id": req_id, "reason": "finished"}
        seen = [t for e in req_events if e["event"] == "update" for t in e["tokens"]]
        # The worker may see tokens the scheduler then drops (past max_tokens,
        # or after the abort): they extend what the user got.
        common = min(len(seen), len(produced[str(i)]))
        assert common > 0 and seen[:common] == produced[str(i)][:common]
        if i != 2:
            assert len(seen) >= len(produced[str(i)])
    proposes = [e for e in events if e["event"] == "propose"]
    assert proposes and all(max(e["lengths"], default=0) <= e["k"] == 3 for e in proposes)
