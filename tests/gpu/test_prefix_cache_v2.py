"""Prefix-cache hits for our head on Model Runner V2 (issue 26): a request
whose prompt starts on cached KV blocks drafts from the whole context, as
vLLM's `eagle3` does (its draft KV lives in those blocks), not from the
uncached suffix alone (integration/v2/prefix_blocks.py). The CPU twin (V1
runner) is `tests/test_tree_eagle_engine_alone.py::
test_chain_acceptance_equals_vllm_eagle3_also_on_prefix_cache_hits`.

Runs on the staged GPU host (docs/gpu.md) with the tiny model and its head
in `$SPECPLUG_GPU_WORK`. CI has no GPU: skipped there, with the reason.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.test_model_runner_v2 import NUM_PROMPTS, _engine, prompts, work  # noqa: F401

BLOCK_SIZE = 32
COPIES = 3  # a burst's copies of each prompt, in one call (as `n` > 1 samples)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (Model Runner V2 runs on CUDA only); run on the staged GPU "
           "host as docs/gpu.md says")


@pytest.fixture(scope="module")
def burst_prompts(work) -> list[dict]:  # noqa: F811
    """20 prompts the other passes never run, of at least a block and a
    token each, every one COPIES times in a row."""
    ids = json.loads((work / "prompts_tiny.json").read_text())[NUM_PROMPTS:]
    fresh = [p for p in ids if len(p) > BLOCK_SIZE + 8][:20]
    return [{"prompt_token_ids": p} for p in fresh for _ in range(COPIES)]


def test_chain_acceptance_equals_vllm_eagle3_on_prefix_cache_hits(work, prompts,  # noqa: F811
                                                                  burst_prompts):
    """Both passes over the same prompts (the second starts on cached
    blocks): our chain (K=3) accepts what vLLM's eagle3 with the same head
    accepts, within 3% (near-ties in the head's argmax may go either way:
    the two implementations sum in other orders), and our speculator
    adopted saved rows for the second pass. Then a burst of new prompts,
    each several times in one call: the copies start on blocks their first
    fills beside them, which no saved rows cover yet; our speculator fills
    them from it (`PrefixBlocks.fill_missed`), and the chain accepts what
    vLLM's does there too (before the fifty-fifth session those copies
    drafted from their uncached suffix alone)."""
    from vllm_specplug.engine import generate, greedy_params, shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    head = work / "tiny-eagle3"
    if not (head / "model.safetensors").exists():
        pytest.skip(f"{head} missing: run bench_tree_cuda.py prepare")

    def acceptance(llm, requests=prompts):
        before = read_spec_decode_counts(llm)
        generate(llm, requests, greedy_params(64))
        return read_spec_decode_counts(llm) - before

    configs = {"ours": {"method": "specplug_eagle3", "model": str(head), "topk": 1,
                        "num_steps": 3, "num_draft_tokens": 4},
               "vllm": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}}
    passes, stats = {}, {}
    for name, config in configs.items():
        llm = _engine(work, config, dtype="float32", block_size=BLOCK_SIZE)
        try:
            passes[name] = (acceptance(llm), acceptance(llm), acceptance(llm, burst_prompts))
            hits = {m.name: m for m in llm.get_metrics()}["vllm:prefix_cache_hits"]
            assert hits.value > 0, f"{name}: the second pass hit no cached block"
            if name == "ours":
                stats = llm.collective_rpc("specplug_prefix_stats")[0]
        finally:
            shutdown_llm(llm)
    assert stats, "our speculator kept no prefix-hit counts (not Model Runner V2's?)"
    assert stats["adopted"] > 0, f"no request started on the head's saved rows: {stats}"
    assert stats["filled"] > 0, f"no burst copy took its first's rows: {stats}"
    for ours, vllm in zip(passes["ours"], passes["vllm"]):
        assert ours.num_drafts > 0
        assert ours.mean_acceptance_length == pytest.approx(
            vllm.mean_acceptance_length, rel=0.03), (ours.mean_acceptance_length,
                                                     vllm.mean_acceptance_length)
