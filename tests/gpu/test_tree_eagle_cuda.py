"""Tree EAGLE on a CUDA GPU (issue 15): our tree attention runs in vLLM's CUDA
attention backend inside captured graphs, and the output equals no
speculation. The recorded 60-prompt run is `benchmarks/gpu/bench_tree_cuda.py
tiny` (docs/results/tree_cuda_h100.txt); this is the regression check.

Run on the staged GPU host (docs/gpu.md) with the tiny model, its head and
prompts in `$SPECPLUG_GPU_WORK` (`bench_model_runner_v2.py prepare` and
`bench_tree_cuda.py prepare`). CI has no GPU: skipped there, with the reason.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_v2 import _engine, _outputs, baseline, prompts, work  # noqa: F401

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (tree attention in vLLM's CUDA backends); run on the staged "
           "GPU host as docs/gpu.md says")

TREE = {"method": "specplug_eagle3", "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
        "draft_temperature": 0.25}


@pytest.fixture(scope="module")
def tree_run(work, prompts):  # noqa: F811
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    head = work / "tiny-eagle3"
    if not (head / "model.safetensors").exists():
        pytest.skip(f"{head} missing: run bench_tree_cuda.py prepare")
    llm = _engine(work, {**TREE, "model": str(head)}, dtype="float32",
                  compilation_config={"max_cudagraph_capture_size": 1024})
    try:
        outputs = _outputs(llm, prompts)
        counts = read_spec_decode_counts(llm)
        state = llm.collective_rpc("specplug_tree_attention_state")[0]
        yield outputs, counts, state
    finally:
        shutdown_llm(llm)


def test_tree_attention_runs_in_the_cuda_backend(tree_run):
    _, _, state = tree_run
    assert state["active"] and state["impl"] == "TritonAttentionImpl", state
    assert state["masked_steps"] > 0, state


def test_tree_eagle_is_lossless_on_cuda(tree_run, baseline):  # noqa: F811
    """Alone: token for token. Batched: token for token except flips of the
    baseline's own fp32 near-ties, as for every method (test_model_runner_v2)."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences

    outputs, counts, _ = tree_run
    alone = [i for i, (a, b) in enumerate(zip(baseline["alone"], outputs["alone"])) if a != b]
    assert not alone, alone
    found = divergences(baseline["batched"], outputs["batched"], baseline["gaps"])
    assert all(d["gap"] < NEAR_TIE_GAP for d in found) and len(found) <= 2, found
    # a trained head on held-out prompts: trees accept several tokens a step
    assert counts.num_drafts and counts.num_accepted_tokens > 2 * counts.num_drafts, counts
