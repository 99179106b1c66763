"""MTP on the built-in MTP model (`tiny-mtp`: the tiny target in MiMo's layout
with one MTP layer trained by our extraction and training), in real engines.

vLLM's own `mtp` (chain): lossless against the same model without
speculation, alone and batched; the trained layer is accepted, an untrained
one of the same shape is not. Ours, `specplug_mtp` (the same layer drafting
EAGLE-2 trees): lossless as a chain and as a 16-node tree; the chain accepts
what vLLM's does, the tree more. A target without MTP layers gets a clear
error from both methods.
"""
from __future__ import annotations

import pytest

from vllm_specplug.testing.engine import generate, greedy_params, make_llm, shutdown_llm
from vllm_specplug.testing.metrics import read_spec_decode_counts
from vllm_specplug.models import end_to_end as e2e
from vllm_specplug.testing.constraints import constraint


K = 3
NUM_EVAL, NUM_ALONE, MAX_NEW_TOKENS, NUM_UNDER_SCHEMA = 24, 4, 48, 8


def run(model_dir, spec, prompts, under_schema: bool = False) -> dict:
    """Greedy outputs batched and alone; with `under_schema`, also under
    the JSON schema of test_tree_eagle_engine.py (grammar-aware trees)."""
    llm = make_llm(model_dir, spec)
    try:
        before = read_spec_decode_counts(llm)
        params = greedy_params(MAX_NEW_TOKENS)
        batched = generate(llm, prompts, params).token_ids
        counts = read_spec_decode_counts(llm) - before
        alone = [generate(llm, [p], params).token_ids[0] for p in prompts[:NUM_ALONE]]
        schema = generate(llm, prompts[:NUM_UNDER_SCHEMA], greedy_params(
            MAX_NEW_TOKENS, structured_outputs=constraint("json"))) if under_schema else None
    finally:
        shutdown_llm(llm)
    return {"batched": batched, "alone": alone, "counts": counts, "schema": schema}


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    return e2e.eval_prompt_ids(tiny_model_dir, NUM_EVAL)


@pytest.fixture(scope="module")
def no_speculation(tiny_mtp_dir, prompts):
    return run(tiny_mtp_dir, None, prompts, under_schema=True)


@pytest.fixture(scope="module")
def trained(tiny_mtp_dir, prompts):
    return run(tiny_mtp_dir, e2e.mtp_config(K), prompts)


@pytest.fixture(scope="module")
def untrained(tiny_model_dir, tmp_path_factory, prompts):
    model = e2e.write_untrained_mtp(tiny_model_dir, tmp_path_factory.mktemp("untrained"))
    return run(model, e2e.mtp_config(K), prompts)


MTP_TREES = {  # name: speculative_config of specplug_mtp
    "ours_chain": {"method": "specplug_mtp", "topk": 1, "num_steps": K},
    "ours_tree16": {"method": "specplug_mtp", "topk": 4, "num_steps": 4,
                    "num_draft_tokens": 16, "draft_temperature": 0.25},
}


@pytest.fixture(scope="module")
def ours_chain(tiny_mtp_dir, prompts):
    return run(tiny_mtp_dir, MTP_TREES["ours_chain"], prompts)


@pytest.fixture(scope="module")
def ours_tree16(tiny_mtp_dir, prompts):
    return run(tiny_mtp_dir, MTP_TREES["ours_tree16"], prompts, under_schema=True)


def test_mtp_trees_under_a_json_schema_equal_no_speculation(ours_tree16, no_speculation):
    """specplug_mtp trees go through the same grammar-aware scheduler."""
    expected = no_speculation["schema"]
    assert all(text.lstrip().startswith("{") for text in expected.texts)
    assert ours_tree16["schema"].token_ids == expected.token_ids


@pytest.mark.parametrize("which", ["trained", "untrained", "ours_chain", "ours_tree16"])
def test_vllm_mtp_on_our_model_is_lossless(which, request, no_speculation):
    outputs = request.getfixturevalue(which)
    assert outputs["counts"].num_drafts > 0, "vLLM did not speculate"
    assert outputs["batched"] == no_speculation["batched"]
    assert outputs["alone"] == no_speculation["alone"]


def test_trained_mtp_layer_is_accepted_and_untrained_is_not(trained, untrained):
    good, bad = trained["counts"], untrained["counts"]
    assert good.mean_acceptance_length >= 2.2, good
    assert all(p > 0.4 for p in good.per_position_acceptance), good
    assert bad.mean_acceptance_length < 1.2, bad


def test_target_without_mtp_layers_gets_a_clear_error(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.proposers.base import ProposerConfigError

    args = EngineArgs(model=str(tiny_model_dir), max_model_len=512,
                      speculative_config=e2e.mtp_config(K))
    with pytest.raises(ProposerConfigError, match="no multi-token-prediction layers") as err:
        args.create_engine_config()
    assert "vllm-specplug train-mtp" in str(err.value) and "LlamaForCausalLM" in str(err.value)


def test_our_mtp_trees_accept_what_vllm_does_and_more(trained, ours_chain, ours_tree16):
    vllm_chain, chain, tree = (r["counts"] for r in (trained, ours_chain, ours_tree16))
    # the same layer, the same chain: vLLM's acceptance, position by position
    assert abs(chain.mean_acceptance_length / vllm_chain.mean_acceptance_length - 1) < 0.03
    for ours, theirs in zip(chain.per_position_acceptance, vllm_chain.per_position_acceptance):
        assert abs(ours - theirs) < 0.03
    assert tree.mean_acceptance_length > chain.mean_acceptance_length + 0.5


def test_specplug_mtp_on_a_target_without_mtp_layers_is_refused(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.proposers.base import ProposerConfigError

    args = EngineArgs(model=str(tiny_model_dir), max_model_len=512,
                      speculative_config=MTP_TREES["ours_tree16"])
    with pytest.raises(ProposerConfigError, match="no MTP layer") as err:
        args.create_engine_config()
    assert "vllm-specplug train-mtp" in str(err.value)
