"""`specplug_mtp` on a CUDA GPU (issue 26): chains and trees from the
target's own MTP layer run on Model Runner V2 with async scheduling
(`SpecplugV2HeadSpeculator`, the same head runtime and tree code as EAGLE-3),
and the output equals no speculation of the same target.

Run on the staged GPU host (docs/gpu.md) with the tiny target's MTP build in
`$SPECPLUG_GPU_WORK/tiny-mtp` (`bench_tree_cuda.py prepare`). CI has no GPU:
skipped there, with the reason.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_v2 import (MAX_TOKENS, V2_RUNNER, _outputs,  # noqa: F401
                                            prompts, work)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (Model Runner V2); run on the staged GPU host as docs/gpu.md says")

MTP = {"chain": {"method": "specplug_mtp", "topk": 1, "num_steps": 3},
       "tree": {"method": "specplug_mtp", "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
                "draft_temperature": 0.25}}


def _engine(target, spec: dict | None):
    from vllm_specplug.engine import make_llm
    from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

    return make_llm(target, spec, enforce_eager=False, gpu_memory_utilization=0.3,
                    worker_extension_cls=PROBE_QUALNAME, dtype="float32")


@pytest.fixture(scope="module")
def mtp_target(work):  # noqa: F811
    target = work / "tiny-mtp"
    if not (target / "model.safetensors").exists():
        pytest.skip(f"{target} missing: run bench_tree_cuda.py prepare")
    return target


@pytest.fixture(scope="module")
def mtp_baseline(mtp_target, prompts) -> dict:  # noqa: F811
    from vllm_specplug.bench.compare import top2_gaps
    from vllm_specplug.engine import greedy_params, shutdown_llm

    llm = _engine(mtp_target, None)
    try:
        outputs = _outputs(llm, prompts)
        outputs["gaps"] = top2_gaps(llm.generate(prompts, greedy_params(MAX_TOKENS, logprobs=2),
                                                 use_tqdm=False))
        return outputs
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module", params=list(MTP))
def mtp_run(request, mtp_target, prompts):  # noqa: F811
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    llm = _engine(mtp_target, MTP[request.param])
    try:
        outputs = _outputs(llm, prompts)
        runner = llm.collective_rpc("specplug_runner_state")[0]
        yield request.param, outputs, read_spec_decode_counts(llm), runner
    finally:
        shutdown_llm(llm)


def test_specplug_mtp_runs_on_model_runner_v2_and_is_lossless(mtp_run, mtp_baseline):
    """Alone: token for token. Batched: token for token except flips of the
    baseline's own fp32 near-ties, as for every method (test_model_runner_v2)."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences

    kind, outputs, counts, runner = mtp_run
    assert runner["runner"] == V2_RUNNER, runner
    assert runner["speculator"] == "SpecplugV2HeadSpeculator", runner
    assert runner["async_scheduling"], runner
    alone = [i for i, (a, b) in enumerate(zip(mtp_baseline["alone"], outputs["alone"]))
             if a != b]
    assert not alone, alone
    found = divergences(mtp_baseline["batched"], outputs["batched"], mtp_baseline["gaps"])
    assert all(d["gap"] < NEAR_TIE_GAP for d in found) and len(found) <= 2, found
    # the trained MTP layer accepts on held-out prompts (CPU, V1 runner: tests/test_mtp_engine.py)
    assert counts.num_drafts and counts.num_accepted_tokens > 0.5 * counts.num_drafts, (kind,
                                                                                       counts)
