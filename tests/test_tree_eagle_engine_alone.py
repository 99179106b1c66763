"""specplug_eagle3 in engines of their own, started one at a time (each
core in this process: no module-wide engine is alive here, which would
send them to processes of their own, 25 s a start): the test's power
against a wrong verifier, chunked prefill with prefix caching and
preemption, and our chain's acceptance against vLLM's eagle3 on prefix-cache
hits. The module-wide tree engines: tests/test_tree_eagle_engine.py."""
from __future__ import annotations

import pytest

from vllm_specplug.testing.compare import assert_same_tokens
from vllm_specplug.testing.engine import generate, greedy_params, make_llm, shutdown_llm
from vllm_specplug.testing.metrics import read_spec_decode_counts
from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

from tests.conftest import MAX_NEW_TOKENS, SAMPLE_TEMPERATURE
from tests.test_cpu_kernel_fix import P_MIN, same_distribution_p, sample_positions
from tests.test_proposers_engine import REPETITIVE
from tests.test_tree_eagle_engine import TREES, tree_config

# the wrong verifier's error is gross (min p 2e-235 at 300 samples, p falls
# exponentially with the count): 100 keep p far below P_MIN at a third of the time
WRONG_SAMPLES = 100


def test_a_wrong_verifier_is_caught(tiny_model_dir, tiny_eagle3_dir, plain_samples):
    """Power: the same test rejects a verifier that accepts every first child."""
    llm = make_llm(tiny_model_dir, tree_config(tiny_eagle3_dir, *TREES["tree16_topk4"]),
                   worker_extension_cls=PROBE_QUALNAME)
    try:
        assert llm.collective_rpc("specplug_break_tree_verifier") == ["AlwaysAcceptFirstChild"]
        wrong = sample_positions(llm, SAMPLE_TEMPERATURE, num_samples=WRONG_SAMPLES)
    finally:
        shutdown_llm(llm)
    assert min(same_distribution_p(plain_samples[p], wrong[p]) for p in (1, 2, 3)) < P_MIN


def test_chunked_prefill_prefix_caching_and_preemption_stay_exact(
        tiny_model_dir, tiny_eagle3_dir, eval_prompts, baseline_llm):
    """Long prompts prefilled in chunks, a shared prefix served from the
    cache, and a KV space so small that requests are preempted and resumed."""
    prompts = [REPETITIVE * 3 + p for p in eval_prompts[:12]]  # shared long prefix
    params = greedy_params(MAX_NEW_TOKENS)
    expected = generate(baseline_llm, prompts, params).token_ids
    llm = make_llm(tiny_model_dir, tree_config(tiny_eagle3_dir, *TREES["tree16_topk4"]),
                   enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=128, block_size=32,
                   num_gpu_blocks_override=24, max_model_len=512)
    try:
        ours = generate(llm, prompts, params).token_ids
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        shutdown_llm(llm)
    assert_same_tokens(expected, ours, prompts)
    assert metrics["vllm:num_preemptions"].value > 0, "no request was preempted"
    assert metrics["vllm:prefix_cache_hits"].value > 0, "the prefix cache was not used"


def test_chain_acceptance_equals_vllm_eagle3_also_on_prefix_cache_hits(
        tiny_model_dir, tiny_eagle3_dir, eval_prompts):
    """topk=1 drafts the chain vLLM's eagle3 drafts with the same head and K,
    on cold prompts and on the same prompts again, whose full KV blocks then
    come from vLLM's prefix cache: vLLM's drafter finds its KV for them in
    those blocks, ours in `HeadBlockStore` (without it our second pass drafted
    from the uncached suffix alone and accepted less). Not token-identical
    drafts: our head runtime and vLLM's model sum in other orders, so a
    near-tie in the head's argmax may go the other way. The acceptance
    therefore agrees within 3% (the real-target issue asks 2% on MT-Bench;
    this checks the mechanism on the tiny head)."""
    from vllm_specplug.models import end_to_end as e2e

    def acceptance(llm):
        before = read_spec_decode_counts(llm)
        generate(llm, eval_prompts, greedy_params(MAX_NEW_TOKENS))
        return read_spec_decode_counts(llm) - before

    configs = {"ours": tree_config(tiny_eagle3_dir, *TREES["chain_k3"]),
               "vllm": e2e.eagle3_config(tiny_eagle3_dir, 3)}
    passes = {}
    for name, config in configs.items():
        llm = make_llm(tiny_model_dir, config, block_size=32)  # prompts fill blocks
        try:
            passes[name] = (acceptance(llm), acceptance(llm))
            hits = {m.name: m for m in llm.get_metrics()}["vllm:prefix_cache_hits"]
            assert hits.value > 0, f"{name}: the second pass hit no cached block"
        finally:
            shutdown_llm(llm)
    # the second pass drafts from the context the first had: the prefix's last
    # row is kept (the same next token; left out, as before the fifty-third
    # session, this pass accepted 2.651 a step against the first's 2.659)
    first, second = passes["ours"]
    assert (second.num_drafts, second.num_accepted_tokens) == (first.num_drafts,
                                                             first.num_accepted_tokens)
    for ours, vllm in zip(passes["ours"], passes["vllm"]):
        assert ours.num_drafts > 0
        assert ours.mean_acceptance_length == pytest.approx(
            vllm.mean_acceptance_length, rel=0.03), (ours.mean_acceptance_length,
                                                     vllm.mean_acceptance_length)
        for a, b in zip(ours.per_position_acceptance, vllm.per_position_acceptance):
            assert a == pytest.approx(b, abs=0.03)
