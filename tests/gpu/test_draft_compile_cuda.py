"""`draft_compile` in engines on a CUDA GPU (proposers/draft_compile.py):
`specplug_eagle3` chains and trees as they run by default there ("auto":
the head's dense steps compiled by inductor inside its captured passes), on
Model Runner V2 with async scheduling. The outputs equal no
speculation's, the captured passes ran the compiled steps, and serving
compiled nothing: with CUDA graphs the compiled steps serve captured passes
only, so an eager pass in service (a prefill's ingest) runs the eager steps
(on the H200 a compile in service once stalled a step 315 ms,
docs/results/v2_tiny3_prof_h200). The speed is `ROWS=compile` of
`benchmarks/gpu/v2_tree_runs.sh`.

Run on the staged GPU host (docs/gpu.md), as tests/gpu/test_tree_eagle_cuda.py.
CI has no GPU: skipped there, with the reason.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_v2 import _engine, _outputs, baseline, prompts, work  # noqa: F401
from tests.gpu.test_tree_eagle_cuda import CHAIN, MIN_ACCEPTED, TREE

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (the head's passes captured as CUDA graphs); run on the staged "
           "GPU host as docs/gpu.md says")

SPECS = {"tree": TREE, "chain": CHAIN}  # draft_compile unset: "auto", compiled on CUDA


@pytest.fixture(scope="module", params=list(SPECS))
def compiled_run(request, work, prompts):  # noqa: F811
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    head = work / "tiny-eagle3"
    if not (head / "model.safetensors").exists():
        pytest.skip(f"{head} missing: run bench_tree_cuda.py prepare")
    llm = _engine(work, {**SPECS[request.param], "model": str(head)}, dtype="float32",
                  compilation_config={"max_cudagraph_capture_size": 1024})
    try:
        at_start = llm.collective_rpc("specplug_graph_captures")[0]
        outputs = _outputs(llm, prompts)
        after = llm.collective_rpc("specplug_graph_captures")[0]
        yield request.param, outputs, read_spec_decode_counts(llm), at_start, after
    finally:
        shutdown_llm(llm)


def test_compiled_drafting_is_lossless(compiled_run, baseline):  # noqa: F811
    """Alone: token for token. Batched: token for token but flips of the
    baseline's own fp32 near-ties (as test_tree_eagle_is_lossless_on_cuda)."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences

    kind, outputs, counts, _, _ = compiled_run
    alone = [i for i, (a, b) in enumerate(zip(baseline["alone"], outputs["alone"])) if a != b]
    assert not alone, alone
    found = divergences(baseline["batched"], outputs["batched"], baseline["gaps"])
    assert all(d["gap"] < NEAR_TIE_GAP for d in found) and len(found) <= 2, found
    assert counts.num_accepted_tokens > MIN_ACCEPTED[kind] * counts.num_drafts, counts


def test_the_captured_passes_run_compiled_and_serving_compiles_nothing(compiled_run):
    """Every compiled step served calls (captures at start-up ran them:
    `compile_status` is None for a step that fell back to eager), and no
    compiled variant or head graph was added while serving the prompts,
    whose prefills ingest eagerly in steps of their own and beside decodes."""
    _, _, _, at_start, after = compiled_run
    status = after["draft_compile"]
    assert all(status[step] for step in ("qkv", "finish", "logits")), status
    variants = {k: v for k, v in after["kernel_compiles"].items() if k.startswith("compiled ")}
    assert variants and variants == {k: at_start["kernel_compiles"][k] for k in variants}, (
        at_start, after)
    assert after["num_captures"] == at_start["num_captures"], (at_start, after)
