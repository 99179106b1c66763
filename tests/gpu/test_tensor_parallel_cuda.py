"""Our methods with the target sharded over 2 GPUs on Model Runner V2
(issue 29): every rank runs the speculator; the draft head is replicated
(each rank holds it whole and drafts the same tree, TP 1), the target's
attention heads and KV cache are split, and our tree verification runs on
each rank's shard of heads. Proposers that draft on the host (suffix,
hybrid) draft on the first rank only, which broadcasts its drafts.

Each engine's outputs must equal the baseline's at TP=2 (alone token for
token, batched but for flips of the baseline's own fp32 near-ties, as on
one GPU), and drafts must be accepted.

Run on a staged 2-GPU host (`nvidia-h100-x2` or `nvidia-h200-x2`, docs/gpu.md)
with the tiny model, its head and its MTP build in `$SPECPLUG_GPU_WORK`. CI
has no GPU: skipped there, with the reason. Seven TP=2 engines take longer
than one 10-minute call: split them with `-k` (docs/gpu.md).
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
HOST_DRAFTERS = ("specplug_suffix", "specplug_hybrid")
SPECS = {  # name: (target, speculative config in the work folder)
    "specplug_ngram": ("tiny", lambda work: {
        "method": "specplug_ngram", "num_speculative_tokens": 5,
        "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
    "specplug_suffix": ("tiny", lambda work: {
        "method": "specplug_suffix", "num_speculative_tokens": 6, "min_token_prob": 0.1}),
    "specplug_hybrid": ("tiny", lambda work: {
        "method": "specplug_hybrid", "num_speculative_tokens": 6,
        "proposers": [{"method": "specplug_suffix", "min_token_prob": 0.3},
                      {"method": "specplug_ngram", "prompt_lookup_max": 3}]}),
    "specplug_eagle3-tree16": ("tiny", lambda work: {
        "method": "specplug_eagle3", "model": str(work / "tiny-eagle3"), **TREE}),
    "specplug_eagle3-chain": ("tiny", lambda work: {
        "method": "specplug_eagle3", "model": str(work / "tiny-eagle3"),
        "topk": 1, "num_steps": 5}),
    "specplug_mtp-tree16": ("tiny-mtp", lambda work: {
        "method": "specplug_mtp", **TREE, "draft_temperature": 0.25}),
}


def _engine(target, spec):
    from vllm_specplug.engine import make_llm
    from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

    return make_llm(target, spec, enforce_eager=False, gpu_memory_utilization=0.3,
                    tensor_parallel_size=2, dtype="float32",
                    worker_extension_cls=PROBE_QUALNAME)


def _outputs(llm, prompts) -> dict:  # noqa: F811
    from vllm_specplug.engine import generate, greedy_params

    params = greedy_params(MAX_TOKENS)
    return {"batched": generate(llm, prompts, params).token_ids,
            "alone": [generate(llm, [p], params).token_ids[0] for p in prompts[:NUM_ALONE]]}


class Baselines:
    """Each target's TP=2 outputs without speculation, made on first use
    (one engine at a time: the methods' engines come between)."""

    def __init__(self, work, prompts) -> None:  # noqa: F811
        self.work, self.prompts, self.outputs = work, prompts, {}

    def __getitem__(self, target: str) -> dict:
        if target not in self.outputs:
            self.outputs[target] = self._run(self.work / target)
        return self.outputs[target]

    def _run(self, target) -> dict:
        from vllm_specplug.bench.compare import top2_gaps
        from vllm_specplug.engine import greedy_params, shutdown_llm

        llm = _engine(target, None)
        try:
            outputs = _outputs(llm, self.prompts)
            outputs["gaps"] = top2_gaps(llm.generate(
                self.prompts, greedy_params(MAX_TOKENS, logprobs=2), use_tqdm=False))
            return outputs
        finally:
            shutdown_llm(llm)


@pytest.fixture(scope="module")
def baselines(work, prompts):  # noqa: F811
    return Baselines(work, prompts)


@pytest.fixture(scope="module", params=list(SPECS))
def ours(request, work, prompts, baselines):  # noqa: F811
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    target, spec = SPECS[request.param]
    _ = baselines[target]  # made before this engine starts: one engine at a time
    llm = _engine(work / target, spec(work))
    try:
        states = llm.collective_rpc("specplug_runner_state")
        before = read_spec_decode_counts(llm)
        outputs = _outputs(llm, prompts)
        stats = llm.collective_rpc("specplug_speculator_stats")
        yield (request.param, target, states, outputs,
               read_spec_decode_counts(llm) - before, stats)
    finally:
        shutdown_llm(llm)


def test_every_rank_runs_our_speculator_on_model_runner_v2(ours):
    name, _, states, _, _, _ = ours
    assert len(states) == 2, states
    for state in states:
        assert state["runner"] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner", state
        assert state["speculator"].startswith("SpecplugV2"), (name, state)


def test_sharded_target_outputs_equal_the_baseline_and_drafts_are_accepted(ours, baselines):
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences

    name, target, _, outputs, counts, stats = ours
    baseline = baselines[target]
    assert outputs["alone"] == baseline["alone"], name
    found = divergences(baseline["batched"], outputs["batched"], baseline["gaps"])
    assert all(d["gap"] < NEAR_TIE_GAP for d in found), (name, found)
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0, (name, counts)
    if name in HOST_DRAFTERS:  # drafted on the host: by the first rank, broadcast to the second
        first, second = stats
        assert first["num_draft_tokens"] > 0 and second["num_draft_tokens"] == 0, stats
        assert first["num_steps"] == second["num_steps"], stats
