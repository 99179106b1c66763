"""Prompts -> extraction -> training -> vLLM's built-in `eagle3` loads our head.

The head is the built-in `tiny-eagle3` (`vllm-specplug build-model
tiny-eagle3`: trained by our extraction + training on the tiny target's own
answers to chat prompts from its training split, cached), served by vLLM; it
must reproduce the target's greedy output exactly and be accepted. (The untrained head of the
same shape is compared side by side in examples/eagle3_end_to_end.py; its
acceptance length there is 1.00.)
"""
import json

import pytest
from vllm import SamplingParams

from vllm_specplug.testing.engine import make_llm, shutdown_llm
from vllm_specplug.testing.metrics import read_spec_decode_counts
from vllm_specplug.models import end_to_end as e2e

K = 3
NUM_EVAL, MAX_NEW_TOKENS = 24, 48


def serve(model_dir, head_dir, prompts):
    llm = make_llm(model_dir, e2e.eagle3_config(head_dir, K))
    try:
        before = read_spec_decode_counts(llm)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS,
                                                       temperature=0.0), use_tqdm=False)
        counts = read_spec_decode_counts(llm) - before
    finally:
        shutdown_llm(llm)
    return [list(o.outputs[0].token_ids) for o in outputs], counts


@pytest.fixture(scope="module")
def trained(tiny_eagle3_dir, tiny_model_dir):
    prompts = e2e.eval_prompt_ids(tiny_model_dir, NUM_EVAL)
    log = json.loads((tiny_eagle3_dir / "training_log.json").read_text())
    return {"history": log["history"], "prompts": prompts,
            "trained": serve(tiny_model_dir, tiny_eagle3_dir, prompts)}


@pytest.fixture(scope="module")
def reference(trained, baseline_llm):
    outputs = baseline_llm.generate(trained["prompts"], SamplingParams(
        max_tokens=MAX_NEW_TOKENS, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_eagle3_with_our_head_is_lossless(trained, reference):
    outputs, counts = trained["trained"]
    assert counts.num_drafts > 0, "vLLM did not speculate with the head"
    assert outputs == reference


def test_trained_head_is_accepted(trained):
    _, good = trained["trained"]
    assert good.mean_acceptance_length >= 1.8
    # every draft position is accepted more often than by chance
    assert all(p > 0.3 for p in good.per_position_acceptance)


def test_held_out_agreement_rose_during_training(trained):
    history = trained["history"]
    first, last = history[0]["agreement"], history[-1]["agreement"]
    assert all(b > a + 0.3 for a, b in zip(first, last))
