"""The Model Runner V2 adapter's host-side logic, on CPU (issue 11).

Model Runner V2 needs CUDA (pinned memory, streams, Triton), so its real
engine tests live in tests/gpu/. Here: the token gather against a plain
reference, the adapter driven through a request lifecycle over stand-ins for
the runner's `req_states` and `input_batch` (the fields it reads, same
shapes and dtypes), and the VllmConfig decision (runner, async scheduling)
on real configs built by vLLM's EngineArgs.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.v2_helpers import K, Spy, States, make_speculator, step
from vllm_specplug.integration.first_rank import FirstRankShare
from vllm_specplug.integration.v2.speculator import gather_step_tokens
from vllm_specplug.proposers.base import StopReason


def test_gather_step_tokens_matches_reference():
    gen = torch.Generator().manual_seed(0)
    all_ids = torch.randint(0, 1000, (7, 33), generator=gen, dtype=torch.int32)
    total_len = torch.tensor([5, 33, 1, 12, 0, 9, 2], dtype=torch.int32)
    idx = torch.tensor([6, 1, 3, 0], dtype=torch.int64)
    num_sampled = torch.tensor([2, 4, 1, 0], dtype=torch.int32)
    got = gather_step_tokens(all_ids, total_len, idx, num_sampled, max_new=4)
    for b, slot in enumerate(idx.tolist()):
        n = int(total_len[slot])
        assert got[b, 0] == num_sampled[b] and got[b, 1] == n
        want = [int(all_ids[slot, max(p, 0)]) for p in range(n - 4, n)]
        assert got[b, 2:].tolist() == want


CYCLE = [7, 8, 9, 10]


def test_adapter_drives_the_lifecycle_and_pads_drafts():
    states = States()
    speculator = make_speculator(states)
    spy = Spy(speculator.session.proposer)
    states.add("a", 3, CYCLE * 3)           # repeats: n-gram drafts the cycle
    states.add("b", 1, [1, 2, 3, 4, 5, 6])  # no repeat: no draft
    states.sample("a", [7])
    drafts, (req_ids, lists), lengths = step(speculator, states, ["a", "b"], [1, 0])
    # b is a prefill chunk (nothing sampled): not started yet, no draft
    assert spy.take() == [("start_request", "a", CYCLE * 3), ("update_request", "a", [7])]
    assert req_ids == ["a", "b"] and lists == [[8, 9, 10], []]
    assert lengths == {"a": 3, "b": 0}
    assert drafts[0].tolist() == [8, 9, 10]

    states.sample("a", [8, 9])   # two tokens accepted
    states.sample("b", [11])     # b's prefill finished
    drafts, (_, lists), _ = step(speculator, states, ["a", "b"], [2, 1])
    assert spy.take() == [("update_request", "a", [8, 9]),
                          ("start_request", "b", [1, 2, 3, 4, 5, 6]),
                          ("update_request", "b", [11])]
    assert lists == [[10, 7, 8], []]
    assert drafts[1].tolist() == [11, 11, 11]  # padded with the history's last token

    # a finishes and c takes its slot; b is preempted and resumes in slot 0
    del states.req_id_to_index["a"]
    states.add("c", 3, [5, 5, 5, 5])
    history_b = states.history("b")
    del states.req_id_to_index["b"]
    states.add("b", 0, history_b, num_prompt=6)
    states.sample("c", [5])
    states.sample("b", [12])
    _, (_, lists), _ = step(speculator, states, ["c", "b"], [1, 1])
    calls = spy.take()
    assert ("stop_request", "a", StopReason.FINISHED) in calls
    assert ("stop_request", "b", StopReason.PREEMPTED) in calls
    assert ("start_request", "c", [5, 5, 5, 5]) in calls
    assert ("start_request", "b", [1, 2, 3, 4, 5, 6]) in calls
    assert ("update_request", "b", [11, 12]) in calls
    assert lists[0] and set(lists[0]) == {5}
    assert speculator.session.active == {"b", "c"}


def test_adapter_takes_drafts_once_and_skips_dummy_runs():
    states = States()
    speculator = make_speculator(states)
    states.add("a", 2, CYCLE * 2)
    states.sample("a", [7])
    step(speculator, states, ["a"], [1])
    assert speculator.take_drafts() == ([], [])
    assert speculator.take_draft_lengths() is None
    batch = SimpleNamespace(num_reqs=1)
    out = speculator.propose(batch, None, None, None, None, None, None, None, None, None,
                             None, dummy_run=True)
    assert out.shape == (1, K)
    assert speculator.take_drafts() == ([], [])


class Broadcast:
    """An in-process stand-in for the group's in-place broadcast from the
    first rank: that rank's call posts its tensor, the next rank's copies it."""

    def __init__(self) -> None:
        self.posted: list[torch.Tensor] = []

    def rank(self, first: bool) -> FirstRankShare:
        def broadcast(drafts: torch.Tensor) -> None:
            if first:
                self.posted.append(drafts.clone())
            else:
                drafts.copy_(self.posted.pop(0))
        return FirstRankShare(first, broadcast)


SUFFIX = {"method": "specplug_suffix", "num_speculative_tokens": K, "min_token_prob": 0.0,
          "max_spec_factor": 4.0, "max_cached_requests": 0, "adaptive": False}


def test_host_drafts_of_a_structured_request_are_the_ones_its_grammar_allows(tiny_model_dir):
    """Model Runner V2 keeps no sampling params: the speculator keeps the
    structured requests' from their first scheduler output and checks their
    drafts with its own grammar (vLLM's manager, on the tiny model's
    tokenizer), as the V1 drafter does. Output "12" under the regex [0-9]+;
    after "1 2" the prompt goes on with "a" three times and "3 4" once: the
    free request drafts "a 1 2", the structured one the likeliest path of
    digits. Finished, the request's grammar is forgotten."""
    import time

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tokenizers.registry import cached_tokenizer_from_config

    from vllm_specplug.integration.v2.structured import StructuredRequests

    one, two, three, four, a = 22, 23, 24, 25, 70  # "1" "2" "3" "4" "a"
    prompt = [one, two, a, one, two, a, one, two, three, four, one, two, a]
    states = States()
    speculator = make_speculator(states, spec_config=SUFFIX)
    config = _config(tiny_model_dir, OUR_SPEC)
    speculator.structured = StructuredRequests(config)
    digits = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    # what vLLM's input processor does to a request (it picks the backend)
    digits.verify(config.model_config, None, config.structured_outputs_config,
                  cached_tokenizer_from_config(config.model_config))
    new = [SimpleNamespace(req_id="digits", sampling_params=digits),
           SimpleNamespace(req_id="free", sampling_params=SamplingParams())]
    speculator.schedule(SimpleNamespace(scheduled_new_reqs=new, finished_req_ids=set()), states)
    assert set(speculator.structured.params) == {"digits"}
    # compiled on the manager's threads: wait for it before the step drafts
    speculator.structured.grammar("digits", np.zeros(0, dtype=np.int32))
    holder = speculator.structured.grammars.tracked["digits"].holder.structured_output_request
    deadline = time.monotonic() + 60
    while holder.grammar is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for req_id, slot in (("digits", 0), ("free", 1)):
        states.add(req_id, slot, prompt + [one], num_prompt=len(prompt))
        states.sample(req_id, [two])
    _, (_, lists), _ = step(speculator, states, ["digits", "free"], [1, 1])
    assert lists[1] == [a, one, two]
    assert lists[0] == [three, four, one]
    speculator.schedule(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids={"digits"}),
                        states)
    assert not speculator.structured and "digits" not in speculator.structured.grammars.tracked


def test_a_sharded_target_drafts_once_on_the_first_rank():
    """At tensor parallelism the first rank drafts and the others take its
    drafts: the second rank's proposer is never called, and its draft
    tensor equals the first rank's, padding included."""
    broadcast = Broadcast()
    first_states, second_states = States(), States()
    first = make_speculator(first_states, shared=broadcast.rank(True))
    second = make_speculator(second_states, shared=broadcast.rank(False))
    spy = Spy(second.session.proposer)
    for states in (first_states, second_states):
        states.add("a", 3, CYCLE * 3)
        states.add("b", 1, [1, 2, 3, 4, 5, 6])
    for tokens in ([7], [8], [9]):
        for states in (first_states, second_states):
            states.sample("a", tokens)
            states.sample("b", [11])
        drafts, (_, lists), _ = step(first, first_states, ["a", "b"], [1, 1])
        taken, second_taken, lengths = step(second, second_states, ["a", "b"], [1, 1])
        assert torch.equal(taken, drafts) and lists[0] and not broadcast.posted
        assert second_taken == ([], []) and lengths is None  # the first rank reports
    assert spy.take() == [] and not second.session.active


# ------------------------------------------------ the VllmConfig decision


def _config(tiny_model_dir, spec: dict, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(tiny_model_dir), speculative_config=spec, max_model_len=512,
                      **kwargs).create_engine_config()


OUR_SPEC = {"method": "specplug_ngram", "num_speculative_tokens": K}
OUR_SCHEDULER = "vllm_specplug.integration.scheduler.SpecplugAsyncScheduler"


def test_cpu_platform_keeps_v1_runner_and_sync_scheduling(tiny_model_dir):
    config = _config(tiny_model_dir, OUR_SPEC)
    assert not config.use_v2_model_runner
    assert not config.scheduler_config.async_scheduling
    assert config.scheduler_config.scheduler_cls is None


@pytest.fixture
def as_if_cuda_with_v2(monkeypatch):
    """CUDA's answer to the two questions our patch asks (is this CUDA? may
    Model Runner V2 run?), everything else from the CPU platform."""
    import vllm.config.vllm as vllm_config_module
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)


def test_ours_on_cuda_gets_v2_runner_and_async_scheduling(tiny_model_dir,
                                                          as_if_cuda_with_v2):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    config = _config(tiny_model_dir, OUR_SPEC)
    assert config.use_v2_model_runner
    assert "speculative method 'custom_class'" not in \
        config._get_v2_model_runner_unsupported_features()
    assert config.scheduler_config.async_scheduling
    assert config.scheduler_config.get_scheduler_cls() is AsyncScheduler
    ours = _config(tiny_model_dir, OUR_SPEC, scheduler_cls=OUR_SCHEDULER)
    assert ours.scheduler_config.async_scheduling
    assert ours.scheduler_config.scheduler_cls == OUR_SCHEDULER


@pytest.mark.parametrize("asked", [None, True])
def test_no_warning_that_async_scheduling_is_unsupported_where_it_runs(
        tiny_model_dir, as_if_cuda_with_v2, asked):
    """vLLM warned "Async scheduling not supported with custom_class-based
    speculative decoding and will be disabled" on Model Runner V2, where our
    patch then turns it on: asked for (and in every engine core, whose
    config is post-initialized again with it on). (On the CPU platform it is
    turned off: the warning is true there.)"""
    import logging

    import vllm.logger

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("vllm.config.vllm")
    logger.addHandler(handler)
    vllm.logger._print_warning_once.cache_clear()  # logged once a process otherwise
    try:
        config = _config(tiny_model_dir, OUR_SPEC, async_scheduling=asked)
    finally:
        logger.removeHandler(handler)
    assert config.scheduler_config.async_scheduling
    assert not [m for m in messages if "Async scheduling not supported" in m], messages


def test_explicit_choices_are_kept(tiny_model_dir, as_if_cuda_with_v2):
    sync = _config(tiny_model_dir, OUR_SPEC, async_scheduling=False)
    assert not sync.scheduler_config.async_scheduling
    mine = _config(tiny_model_dir, OUR_SPEC, async_scheduling=True,
                   scheduler_cls="vllm.v1.core.sched.async_scheduler.AsyncScheduler")
    assert mine.scheduler_config.async_scheduling
    assert mine.scheduler_config.scheduler_cls == \
        "vllm.v1.core.sched.async_scheduler.AsyncScheduler"


@pytest.mark.parametrize("topk", [1, 2])
def test_tree_eagle_on_cuda_gets_v2_runner_and_async_scheduling(
        tiny_model_dir, tiny_eagle3_dir, as_if_cuda_with_v2, topk):
    """Chains and trees run on Model Runner V2 (integration/v2/), with
    async scheduling under our `AsyncScheduler` subclass that checks
    grammars per tree node (issue 30); the CPU platform keeps them on the V1
    runner."""
    from vllm_specplug.integration.scheduler import SpecplugTreeAsyncScheduler

    spec = {"method": "specplug_eagle3", "model": str(tiny_eagle3_dir), "topk": topk,
            "num_steps": 3, "num_draft_tokens": 4}
    config = _config(tiny_model_dir, spec)
    assert config.use_v2_model_runner
    assert "speculative method 'custom_class'" not in \
        config._get_v2_model_runner_unsupported_features()
    assert config.scheduler_config.async_scheduling
    assert config.scheduler_config.get_scheduler_cls() is SpecplugTreeAsyncScheduler
    assert config.speculative_config.num_speculative_tokens == 3  # nodes but the root
    named = _config(tiny_model_dir, spec,
                    scheduler_cls="vllm.v1.core.sched.async_scheduler.AsyncScheduler")
    assert named.scheduler_config.scheduler_cls == \
        "vllm.v1.core.sched.async_scheduler.AsyncScheduler"  # the user's choice is kept


def test_tree_eagle_on_cpu_keeps_v1_runner(tiny_model_dir, tiny_eagle3_dir):
    spec = {"method": "specplug_eagle3", "model": str(tiny_eagle3_dir), "topk": 2,
            "num_steps": 2, "num_draft_tokens": 4}
    config = _config(tiny_model_dir, spec)
    assert not config.use_v2_model_runner
    assert not config.scheduler_config.async_scheduling


def _tree_budget_spec(head_dir) -> dict:
    return {"method": "specplug_eagle3", "model": str(head_dir), "topk": 4, "num_steps": 4,
            "num_draft_tokens": 16, "adaptive": True}


def test_tree_budget_runs_on_the_v1_runner_with_one_rank(tiny_model_dir, tiny_eagle3_dir):
    config = _config(tiny_model_dir, _tree_budget_spec(tiny_eagle3_dir))
    assert not config.use_v2_model_runner


def test_tree_budget_runs_on_a_sharded_target_and_not_over_pipeline_stages(
        tiny_model_dir, tiny_eagle3_dir):
    """At tensor parallelism the first rank sizes every rank's trees
    (tests/test_tensor_parallel_engine.py runs it); pipeline stages are
    refused, naming the fix. (vLLM's config validation wraps our error: the
    message is ours.)"""
    config = _config(tiny_model_dir, _tree_budget_spec(tiny_eagle3_dir), tensor_parallel_size=2)
    assert config.speculative_config is not None and not config.use_v2_model_runner
    with pytest.raises(ValueError, match="adaptive=true.*not on 2 pipeline stages.*Drop"):
        _config(tiny_model_dir, _tree_budget_spec(tiny_eagle3_dir), pipeline_parallel_size=2)


def test_batch_mode_on_the_v1_runner_and_bad_values(tiny_model_dir, tiny_eagle3_dir):
    """`"adaptive": "batch"` on CPU: the sync variants, the tree's with its
    grammar checks; a value that is none of true, false, "batch" is refused
    naming them."""
    from vllm_specplug.integration.batch_schedule import (
        SpecplugBatchDraftScheduler, SpecplugBatchDraftTreeScheduler)

    free = _config(tiny_model_dir, {**OUR_SPEC, "adaptive": "batch"})
    assert free.scheduler_config.get_scheduler_cls() is SpecplugBatchDraftScheduler
    assert free.speculative_config.num_speculative_tokens_per_batch_size is None
    tree = _config(tiny_model_dir, {**_tree_budget_spec(tiny_eagle3_dir), "adaptive": "batch"})
    assert tree.scheduler_config.get_scheduler_cls() is SpecplugBatchDraftTreeScheduler
    with pytest.raises(ValueError, match="adaptive='per-step' must be true, false or 'batch'"):
        _config(tiny_model_dir, {**OUR_SPEC, "adaptive": "per-step"})


def test_model_runner_v2_chooses_one_draft_length_per_step(tiny_model_dir,
                                                           as_if_cuda_with_v2):
    """Model-free methods with adaptive=true: our scheduler in the place of
    vLLM's dynamic table, whose lengths (every one captured) are the
    candidates; not by default yet (BATCH_DRAFT_LENGTH_BY_DEFAULT); a
    user's static table is kept as given, and with adaptive=true its
    lengths are the candidates."""
    from vllm_specplug.integration.batch_schedule import SpecplugBatchDraftAsyncScheduler
    from vllm_specplug.integration.config import BATCH_DRAFT_LENGTH_BY_DEFAULT

    config = _config(tiny_model_dir, {**OUR_SPEC, "adaptive": True})
    assert config.scheduler_config.get_scheduler_cls() is SpecplugBatchDraftAsyncScheduler
    table = config.speculative_config.num_speculative_tokens_per_batch_size
    k = config.speculative_config.num_speculative_tokens
    assert sorted({entry[2] for entry in table}) == sorted({0, 1, k} | {2 ** i for i in
                                                                     range(k.bit_length())
                                                                     if 2 ** i < k})
    off = _config(tiny_model_dir, {**OUR_SPEC, "adaptive": False})
    assert off.scheduler_config.scheduler_cls is None
    assert off.speculative_config.num_speculative_tokens_per_batch_size is None
    default = _config(tiny_model_dir, OUR_SPEC)
    assert (default.scheduler_config.scheduler_cls is not None) == BATCH_DRAFT_LENGTH_BY_DEFAULT
    mine = [(1, 4, 3), (5, 256, 1)]
    given = _config(tiny_model_dir, {**OUR_SPEC, "num_speculative_tokens_per_batch_size": mine,
                                     "adaptive": False})
    assert given.scheduler_config.scheduler_cls is None  # a static table, as given
    chosen = _config(tiny_model_dir, {**OUR_SPEC, "num_speculative_tokens_per_batch_size": mine,
                                      "adaptive": True})
    assert chosen.scheduler_config.get_scheduler_cls() is SpecplugBatchDraftAsyncScheduler
    assert chosen.speculative_config.num_speculative_tokens_per_batch_size == mine


def test_tree_budget_on_model_runner_v2_is_one_tree_size_per_step(
        tiny_model_dir, tiny_eagle3_dir, as_if_cuda_with_v2):
    """`adaptive: true` for a tree on V2: grammar-aware trees, one size per
    step; a user's scheduler rules it out, and the error names the fix."""
    from vllm_specplug.integration.batch_schedule import (
        SpecplugBatchDraftTreeAsyncScheduler)
    from vllm_specplug.integration.scheduler import TreeGrammarScheduler

    config = _config(tiny_model_dir, _tree_budget_spec(tiny_eagle3_dir))
    cls = config.scheduler_config.get_scheduler_cls()
    assert cls is SpecplugBatchDraftTreeAsyncScheduler and issubclass(cls, TreeGrammarScheduler)
    lengths = {entry[2] for entry in
               config.speculative_config.num_speculative_tokens_per_batch_size}
    assert lengths == {0, 1, 2, 4, 8, 15}
    static = _config(tiny_model_dir, {**_tree_budget_spec(tiny_eagle3_dir), "adaptive": False})
    assert static.speculative_config.num_speculative_tokens_per_batch_size is None
    with pytest.raises(ValueError, match="not on Model Runner V2.*Drop adaptive, or the scheduler_cls"):
        _config(tiny_model_dir, _tree_budget_spec(tiny_eagle3_dir),
                scheduler_cls="vllm.v1.core.sched.async_scheduler.AsyncScheduler")
