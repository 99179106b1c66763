"""Our head speculator makes the host wait for the GPU nowhere in a step
(issue 26). On the H100 its eager prefill ingest indexed the GPU's rows with
a host array: two blocking copies in every step with a prefill, which held
the host behind the GPU where vLLM's `eagle3` made none of its own
(docs/results/v2_host_syncs_h100_s70). PyTorch reports every synchronising
operation of the worker's steps (`vllm_specplug.testing.host_syncs`); none
may come from our package, in first, mixed or decode steps, for a chain and
a tree, with prefix-cache hits (the second pass over the same prompts).

Runs on the staged GPU host (docs/gpu.md) with the tiny model and its head
in `$SPECPLUG_GPU_WORK`. CI has no GPU: skipped there, with the reason.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_v2 import _engine, prompts, work  # noqa: F401
from tests.gpu.test_tree_eagle_cuda import CHAIN, TREE

MAX_NUM_SEQS = 8  # under the 24 prompts: requests start beside decoding ones (mixed steps)
NUM_PROMPTS = 24
MAX_TOKENS = 24

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (Model Runner V2 runs on CUDA only); run on the staged GPU "
           "host as docs/gpu.md says")


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_no_step_of_ours_waits_for_the_gpu(work, prompts, name):  # noqa: F811
    from vllm_specplug.engine import generate, greedy_params, shutdown_llm

    head = work / "tiny-eagle3"
    assert (head / "model.safetensors").exists(), \
        f"{head} missing: run bench_tree_cuda.py prepare"
    spec = {**{"chain": CHAIN, "tree": TREE}[name], "model": str(head)}
    llm = _engine(work, spec, max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=True,
                  compilation_config={"max_cudagraph_capture_size": 1024})
    try:
        params = greedy_params(MAX_TOKENS)
        generate(llm, prompts[:MAX_NUM_SEQS], params)  # warm-up: start-up's syncs are by design
        llm.collective_rpc("specplug_watch_syncs")
        for _ in range(2):  # the second pass starts on cached blocks: adopted head rows
            generate(llm, prompts[:NUM_PROMPTS], params)
        report = llm.collective_rpc("specplug_syncs")[0]
        adopted = llm.collective_rpc("specplug_prefix_stats")[0]
    finally:
        shutdown_llm(llm)
    assert report["num_steps"].get("first", 0) and report["num_steps"].get("mixed", 0) \
        and report["num_steps"].get("decode", 0), report["num_steps"]
    assert adopted["adopted"] > 0, adopted
    assert report["ours"] == {}, {site: report["callers"][site] for site in report["ours"]}
