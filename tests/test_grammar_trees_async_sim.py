"""Constrained trees through vLLM's async engine-core loop on CPU, with the
rows of our tree scheduler (`grammar_rows: "scheduler"` on Model Runner V2):
every request's output equals greedy decoding under its grammar, with many
steps deferred, trees pruned and siblings that are valid continuations
(testing/grammar_async_sim.py)."""
from __future__ import annotations

import random
import time

import pytest

from vllm_specplug.integration.batch_schedule import SpecplugBatchDraftTreeAsyncScheduler
from vllm_specplug.integration.scheduler import SpecplugTreeAsyncScheduler
from vllm_specplug.testing import grammar_async_sim as gsim
from vllm_specplug.testing import scheduler_sim as sim
from vllm_specplug.testing.constraints import REGEX

NUM_REQUESTS = 12
MAX_TOKENS = 24


def _engine(tiny_model_dir, seed: int, hit: float, max_num_seqs: int = 16,
            max_tokens: int = MAX_TOKENS, scheduler_cls=SpecplugTreeAsyncScheduler):
    """(scheduler, worker) with NUM_REQUESTS regex requests added, their
    grammars compiled, and each one's reference output."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request

    scheduler = sim.make_scheduler(scheduler_cls, str(tiny_model_dir),
                                   async_scheduling=True,
                                   num_speculative_tokens=gsim.NUM_DRAFTS,
                                   max_num_seqs=max_num_seqs)
    manager = scheduler.structured_output_manager
    target, rng, refs = gsim.Target(vocab_size=4096, seed=seed), random.Random(seed), {}
    for index in range(NUM_REQUESTS):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                structured_outputs=StructuredOutputsParams(regex=REGEX))
        params.structured_outputs._backend = "xgrammar"
        params.update_from_generation_config({}, eos_token_id=1)  # as the engine's front end
        prompt = [rng.randrange(2, 4096) for _ in range(rng.randrange(4, 9))]
        request = Request(str(index), prompt, params, None)
        manager.grammar_init(request)
        for _ in range(600):
            if request.structured_output_request.grammar is not None:
                break
            time.sleep(0.05)
        fresh = manager.backend.compile_grammar(
            *request.structured_output_request.structured_output_key)
        refs[str(index)] = gsim.reference(target, fresh, index, max_tokens, stop_id=1)
        scheduler.add_request(request)
    return scheduler, gsim.TreeWorker(target, refs, hit=hit, seed=seed)


@pytest.mark.parametrize("seed, max_num_seqs, max_tokens, scheduler_cls", [
    (0, 16, MAX_TOKENS, SpecplugTreeAsyncScheduler),  # every request at once
    # requests join as others finish: prefills beside trees
    (1, 4, MAX_TOKENS, SpecplugTreeAsyncScheduler),
    (2, 4, 8, SpecplugTreeAsyncScheduler),  # trees drafted past max_tokens
    # one tree size per step ("adaptive": true on Model Runner V2)
    (3, 4, MAX_TOKENS, SpecplugBatchDraftTreeAsyncScheduler),
], ids=["all-at-once", "joining", "past-max-tokens", "one-size-per-step"])
def test_scheduler_rows_through_the_deferred_step_equal_greedy_under_the_grammar(
        tiny_model_dir, seed, max_num_seqs, max_tokens, scheduler_cls):
    scheduler, worker = _engine(tiny_model_dir, seed, 0.8, max_num_seqs, max_tokens,
                                scheduler_cls)
    outputs = gsim.run(scheduler, worker)
    expected = {req_id: request.ref for req_id, request in worker.requests.items()}
    assert outputs == expected
    # trees were verified over the deferred step's rows, and drafts accepted
    assert worker.num_verified_trees >= 2 * NUM_REQUESTS
    assert worker.num_accepted > NUM_REQUESTS


def test_the_check_fails_where_a_tree_is_read_as_a_list(tiny_model_dir, monkeypatch):
    """The same run with the parents withheld from the scheduler, so vLLM
    reads each tree as a list (a sibling taken as a continuation) while the
    worker walks it as a tree: some output differs."""
    scheduler, worker = _engine(tiny_model_dir, 0, hit=0.8)
    take = worker.take_drafts

    def without_parents():
        drafts = take()
        setattr(drafts, gsim.TREE_PARENTS_ATTR, {})
        return drafts

    monkeypatch.setattr(worker, "take_drafts", without_parents)
    outputs = gsim.run(scheduler, worker)
    assert outputs != {req_id: request.ref for req_id, request in worker.requests.items()}
