"""Our methods with the target sharded over 2 GPUs on Model Runner V2
(issue 29): every rank runs the speculator; the draft head is replicated
(each rank holds it whole and drafts the same tree, TP 1), the target's
attention heads and KV cache are split, and our tree verification runs on
each rank's shard of heads.

Each engine's outputs must equal the baseline's at TP=2 (alone token for
token, batched but for flips of the baseline's own fp32 near-ties, as on
one GPU), and drafts must be accepted.

Run on a staged 2-GPU host (`nvidia-h100-x2` or `nvidia-h200-x2`, docs/gpu.md)
with the tiny model, its head and its MTP build in `$SPECPLUG_GPU_WORK`. CI
has no GPU: skipped there, with the reason.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_v2 import prompts, work  # noqa: F401

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (a target sharded with tensor_parallel_size=2 on Model "
           "Runner V2); run on a staged 2-GPU host as docs/gpu.md says")

MAX_TOKENS = 48
NUM_ALONE = 2
TREE = {"topk": 4, "num_steps": 4, "num_draft_tokens": 16}
SPECS = {
    "specplug_ngram": lambda work: {"method": "specplug_ngram", "num_speculative_tokens": 5,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "specplug_eagle3-tree16": lambda work: {"method": "specplug_eagle3",
                                            "model": str(work / "tiny-eagle3"), **TREE},
    "specplug_eagle3-chain": lambda work: {"method": "specplug_eagle3",
                                           "model": str(work / "tiny-eagle3"),
                                           "topk": 1, "num_steps": 5},
}


def _engine(work, spec):  # noqa: F811
    from vllm_specplug.engine import make_llm
    from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

    return make_llm(work / "tiny", spec, enforce_eager=False, gpu_memory_utilization=0.3,
                    tensor_parallel_size=2, dtype="float32",
                    worker_extension_cls=PROBE_QUALNAME)


def _outputs(llm, prompts) -> dict:  # noqa: F811
    from vllm_specplug.engine import generate, greedy_params

    params = greedy_params(MAX_TOKENS)
    return {"batched": generate(llm, prompts, params).token_ids,
            "alone": [generate(llm, [p], params).token_ids[0] for p in prompts[:NUM_ALONE]]}


@pytest.fixture(scope="module")
def baseline(work, prompts):  # noqa: F811
    from vllm_specplug.bench.compare import top2_gaps
    from vllm_specplug.engine import greedy_params, shutdown_llm

    llm = _engine(work, None)
    try:
        outputs = _outputs(llm, prompts)
        outputs["gaps"] = top2_gaps(llm.generate(prompts, greedy_params(MAX_TOKENS, logprobs=2),
                                                 use_tqdm=False))
        return outputs
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module", params=list(SPECS))
def ours(request, work, prompts):  # noqa: F811
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    llm = _engine(work, SPECS[request.param](work))
    try:
        states = llm.collective_rpc("specplug_runner_state")
        before = read_spec_decode_counts(llm)
        outputs = _outputs(llm, prompts)
        yield request.param, states, outputs, read_spec_decode_counts(llm) - before
    finally:
        shutdown_llm(llm)


def test_every_rank_runs_our_speculator_on_model_runner_v2(ours):
    name, states, _, _ = ours
    assert len(states) == 2, states
    for state in states:
        assert state["runner"] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner", state
        assert state["speculator"].startswith("SpecplugV2"), (name, state)


def test_sharded_target_outputs_equal_the_baseline_and_drafts_are_accepted(ours, baseline):
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences

    name, _, outputs, counts = ours
    assert outputs["alone"] == baseline["alone"], name
    found = divergences(baseline["batched"], outputs["batched"], baseline["gaps"])
    assert all(d["gap"] < NEAR_TIE_GAP for d in found), (name, found)
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0, (name, counts)
