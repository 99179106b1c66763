"""`SpecplugV2HeadSpeculator`'s chain drafts, through its own step path on
CPU (`tests/v2_head_driver.py`: a step of prefills, then decode steps as
Model Runner V2 hands them over, verified greedily against the target's
continuations), equal the drafts of a plain `HeadRuntime` fed the same
verified positions step by step: new requests, the prefills' ingest, the
fused decode step's verified rows and its one pass lose nothing of the
head's drafting. The built-in model and head in float32, where both paths
run the same operations.

Why: on the H200 our chain's τ on SmolLM2 fell under vLLM's `eagle3` with
the same head (docs/results/smollm2_sets_large_h200). This test clears the
speculator's host-side layout of the step; the drafting's GPU paths are
`tests/gpu/test_head_acceptance_cuda.py`'s."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "offline_head_acceptance.py"


def _continuations(tiny_model_dir, tiny_eagle3_dir, num_prompts: int, max_tokens: int):
    from vllm_specplug.cli.bench_inputs import load_prompts
    from vllm_specplug.draft_models.eagle3_model import Eagle3Head

    spec = importlib.util.spec_from_file_location("offline_head_acceptance", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    aux_ids = Eagle3Head.from_pretrained(tiny_eagle3_dir).config.aux_layer_ids
    return script.continuations(str(tiny_model_dir), load_prompts("held-out", num_prompts),
                                aux_ids, max_tokens, "cpu")


def test_the_v2_speculators_chain_drafts_equal_the_plain_runtimes(tiny_model_dir,
                                                                  tiny_eagle3_dir):
    from tests.v2_head_driver import HeadEngine

    found, embed = _continuations(tiny_model_dir, tiny_eagle3_dir, 6, 48)
    engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                        embed.num_embeddings, found, {"topk": 1, "num_steps": 5})
    engine.run()
    assert engine.num_steps > 6 * 48 // 6  # decode steps of every request
    assert engine.num_differing == 0, engine.num_differing
    assert (engine.accepted == engine.reference_accepted).all()
    # drafts that count: the built-in head on its own model's text
    assert 1 + engine.accepted.sum() / engine.num_steps > 2.5
