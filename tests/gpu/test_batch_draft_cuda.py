"""One tree size per step for the batch on Model Runner V2 (issue 27, item 2):
after steps without drafts, the head's drafts are accepted as before.

`"adaptive": true` on CUDA puts `SpecplugBatchDraftTreeAsyncScheduler` in
vLLM's async scheduler; on a step that drafts nothing the head speculator
keeps the verified rows (integration/v2/deferred_rows.py) and ingests them
before its next draft, or when a slot's store is full, so that its cache
follows the request. TensorRT-LLM found acceptance silently collapsing after such steps
(TensorRT-LLM #16888). The CPU twin on the V1 runner is
tests/test_batch_draft_engine.py; this one runs the fused decode step, its
graphs and async scheduling. The step costs are pinned on the scheduler's
own step times, as there, so each phase's choice does not depend on the GPU.

Run on the staged GPU host (docs/gpu.md) with the tiny model and its head
in `$SPECPLUG_GPU_WORK`. CI has no GPU: skipped there, with the reason.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_v2 import _engine, baseline, prompts, work  # noqa: F401
from tests.gpu.test_tree_eagle_cuda import TREE
from tests.test_batch_draft_engine import CHEAP, COSTLY, NUM_COSTLY_STEPS, _phased, _scheduler

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (Model Runner V2 and its async scheduling); run on the staged "
           "GPU host as docs/gpu.md says")


@pytest.fixture(scope="module")
def batch_llm(work, baseline):  # noqa: F811
    """After the baseline's engine: vLLM's metrics are the last engine's made
    (it unregisters the ones before), and the test reads this one's."""
    from vllm_specplug.engine import shutdown_llm

    head = work / "tiny-eagle3"
    if not (head / "model.safetensors").exists():
        pytest.skip(f"{head} missing: run bench_tree_cuda.py prepare")
    llm = _engine(work, {**TREE, "model": str(head), "adaptive": True}, dtype="float32",
                  compilation_config={"max_cudagraph_capture_size": 1024})
    assert type(_scheduler(llm)).__name__ == "SpecplugBatchDraftTreeAsyncScheduler"
    yield llm
    shutdown_llm(llm)


def _exact(baseline, token_ids) -> None:  # noqa: F811
    """Token for token but for flips of the baseline's own fp32 near-ties,
    as test_tree_eagle_is_lossless_on_cuda allows."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences

    found = divergences(baseline["batched"], token_ids, baseline["gaps"])
    assert all(d["gap"] < NEAR_TIE_GAP for d in found) and len(found) <= 2, found


def test_drafts_after_steps_without_drafts_are_accepted_as_before(batch_llm, prompts,  # noqa: F811
                                                                   baseline):
    """The largest tree from the first step, then the same prompts with
    NUM_COSTLY_STEPS steps at 0 drafts first: exact, at least half of those
    steps drafted nothing, and the trees after them were accepted as well as
    the whole run's (within 15%)."""
    largest = _scheduler(batch_llm).draft_length.candidates[-1]
    whole, (reference,), cheap = _phased(batch_llm, prompts, [(None, CHEAP)], (0, largest))
    _exact(baseline, whole)
    assert cheap.current == largest, cheap.as_dict()
    before = _kept(batch_llm)
    token_ids, (_, resumed), policy = _phased(
        batch_llm, prompts, [(NUM_COSTLY_STEPS, COSTLY), (None, CHEAP)], (0, largest))
    assert policy.lengths[0].num_chosen >= NUM_COSTLY_STEPS // 2, policy.as_dict()
    after = _kept(batch_llm)  # the head ran no pass at 0 drafts, and took the rows later
    assert after["num_kept_steps"] - before["num_kept_steps"] >= NUM_COSTLY_STEPS // 2, after
    assert after["num_flushes"] > before["num_flushes"], (before, after)
    # graphs captured at start-up kept them, one replay a step (deferred_rows.py)
    assert after["num_kept_by_graph"] - before["num_kept_by_graph"] >= NUM_COSTLY_STEPS // 2, after
    _exact(baseline, token_ids)
    assert reference.num_drafts > 0 and resumed.num_drafts > 0
    assert resumed.mean_acceptance_length >= 0.85 * reference.mean_acceptance_length, (
        resumed.mean_acceptance_length, reference.mean_acceptance_length)


def test_a_trees_paths_teach_the_policy_every_smaller_size(batch_llm, prompts,  # noqa: F811
                                                          baseline):
    """The V2 twin of the CPU engine's test: the tree steps' paths the head
    records (one in `RECORD_EVERY`, that many times rarer once the policy
    settled) reach the policy a step or more late (their nodes' ranks,
    copied behind the step's work: integration/v2/path_ranks.py, from graphs
    captured with the ranks), and the smaller size learns from them: exact,
    at least half of the records read, and 4 drafts' estimate stays at most
    the longest's."""
    longest = _scheduler(batch_llm).draft_length.candidates[-1]
    before = _paths_recorded(batch_llm)
    token_ids, _, policy = _phased(batch_llm, prompts, [(None, CHEAP)], (0, 4, longest))
    recorded = _paths_recorded(batch_llm) - before
    _exact(baseline, token_ids)
    assert policy.current == longest and recorded > 0, (recorded, policy.as_dict())
    assert policy.stats.num_path_steps >= recorded // 2, (policy.stats, recorded)
    assert 1.0 < policy.expected_tokens(4) <= policy.expected_tokens(longest)


def _kept(llm) -> dict:
    """The speculator's counts of steps whose rows it kept, and of flushes."""
    return llm.collective_rpc(lambda worker: worker.model_runner.speculator.stats.as_dict())[0]


def _paths_recorded(llm) -> int:
    """Tree steps whose paths the head recorded so far."""
    return llm.collective_rpc(
        lambda worker: worker.model_runner.speculator.path_ranks.num_recorded)[0]


def test_the_same_requests_again_capture_no_graph_of_the_head(batch_llm, prompts,  # noqa: F811
                                                              baseline):
    """A run's graphs of the head are captured at start-up or on their first
    use: the same requests again, at the same length (the policy pinned to
    one), capture none (each capture stalls its step, 8-960 ms on the H200). There the
    adaptive tree's `generate` calls each ran 18-27 ms over the static
    tree's, and the pinned policy's fifth pass over the same prompts still
    captured two graphs (docs/results/batch_draft_length_h200_run11)."""
    pinned = (_scheduler(batch_llm).draft_length.candidates[-1],)  # no tries: one path
    _phased(batch_llm, prompts, [(None, CHEAP)], pinned)
    before = batch_llm.collective_rpc("specplug_graph_captures")[0]
    token_ids, _, policy = _phased(batch_llm, prompts, [(None, CHEAP)], pinned)
    after = batch_llm.collective_rpc("specplug_graph_captures")[0]
    _exact(baseline, token_ids)
    assert after["num_captures"] == before["num_captures"], (before, after, policy.as_dict())


# what the speculator's capture() launches (integration/v2/kernel_warmup.py)
WARMED_KERNELS = {"verify_tree_greedy_rows_kernel", "compact_kv_layers_kernel",
                  "verified_rows_kernel", "head_attention_kernel"}


def test_the_tree_steps_eager_kernels_compile_at_start_up(batch_llm, prompts,  # noqa: F811
                                                          baseline):
    """Each length the policy may choose, pinned in turn (each verifies its
    own rows per request): none of the kernels the start-up warmed compiled
    in service. Before it, vLLM's warm-up reached none of them and they
    compiled on a served engine's first requests, 2-4 s on the H200
    (docs/results/batch_draft_length_h200_run13, JIT_VERBOSE)."""
    for length in _scheduler(batch_llm).draft_length.candidates:
        token_ids, _, _ = _phased(batch_llm, prompts, [(None, CHEAP)], (length,))
        _exact(baseline, token_ids)
    compiles = batch_llm.collective_rpc("specplug_graph_captures")[0]["kernel_compiles"]
    assert not WARMED_KERNELS & set(compiles), compiles
