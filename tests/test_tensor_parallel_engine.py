"""Tensor parallelism on CPU: the tiny target sharded over 2 ranks (vLLM's V1
runner, one worker process per rank, each drafting for itself), for every
kind of method of ours (model-free through `specplug_hybrid`, EAGLE-3 tree
under its budget, MTP tree): greedy output equal to the same sharded target's without
speculation, and speculating (the model-free ones under their adaptive
controller, on by default, drafting on the first rank only: the scheduler
hands its drafts to both), the tree budget (the first rank sizes both
ranks' trees); and the fault guard. Extraction at
TP=2: tests/test_extraction_engine.py. On this one-NUMA-node machine the plugin
gives each rank its share of the CPUs (integration/cpu_threads.py;
tests/test_cpu_threads_unit.py). Each engine runs its prompts once and stops
before the next starts.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from vllm_specplug.integration.cpu_threads import ENV, OURS, per_rank_cpus, thread_binding
from vllm_specplug.metrics import read_spec_decode_counts
from vllm_specplug.testing.compare import assert_same_tokens
from vllm_specplug.testing.engine import generate, greedy_params, make_llm, shutdown_llm
from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

from tests.test_mtp_engine import MTP_TREES
from tests.test_proposers_engine import CONFIGS as PROPOSERS
from tests.test_tree_eagle_engine import TREES, tree_config

TP = 2
NUM_PROMPTS = 8  # of the held-out prompts: enough to speculate, at TP=2 cost
MAX_TOKENS = 48
# (target, speculative config) per method; the MTP layer lives in its target.
# The EAGLE-3 tree runs once, under its budget: the first rank's pin keeps
# trees (`num_kept`, asserted below), verified on both ranks, so that engine
# covers tree verification at TP=2 (one with the static tree cost ~30 s of CI).
# No EAGLE-3 chain of its own (~25 s of CI): the tree's engine drafts with
# the same head on both ranks, and hybrid's drafts are verified as chains.
# Of the model-free methods, hybrid: it drafts with both the n-gram and the
# suffix proposers (each rank its own), so it covers both at TP=2 for the cost
# of one engine (each TP=2 engine costs 20-25 s of start-up here; ngram and
# suffix alone run on one rank in tests/test_proposers_engine.py).
METHODS = {
    "specplug_hybrid": ("tiny", PROPOSERS["specplug_hybrid"]),
    "mtp_tree16": ("tiny-mtp", MTP_TREES["ours_tree16"]),
    "eagle3_tree16_budget": ("tiny", ("eagle3", TREES["tree16_topk4"], {"adaptive": True})),
}
# The tree budget's ranks pinned to disagree (tests/test_tree_budget_engine.py:
# (fixed ms, ms per verified token)): on its own clock the first rank would
# keep whole trees, the second skip every drafting pass. Each rank must keep
# the first rank's trees, whose tokens the scheduler sends to both.
DISAGREEING_PINS = ((1000.0, 1e-6, 0), (0.0, 1000.0, 1))


@contextmanager
def _unset_binding():
    """As a user who set no thread binding: the plugin chooses one. The
    suite's own ("nobind", engine.set_cpu_defaults) is back afterwards."""
    saved = {name: os.environ.pop(name, None) for name in (ENV, OURS)}
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def _run(target_dir, config, prompts, pins=()) -> dict:
    with _unset_binding():
        llm = make_llm(target_dir, config, tensor_parallel_size=TP,
                       worker_extension_cls=PROBE_QUALNAME)
        binding = os.environ.get(ENV)
        try:
            for pin in pins:  # (fixed ms, ms per token, rank)
                llm.collective_rpc("specplug_adaptive_pin", args=pin)
            before = read_spec_decode_counts(llm)
            token_ids = generate(llm, prompts, greedy_params(MAX_TOKENS)).token_ids
            return {"token_ids": token_ids, "binding": binding,
                    "counts": read_spec_decode_counts(llm) - before,
                    "adaptive": llm.collective_rpc("specplug_adaptive_stats")}
        finally:
            shutdown_llm(llm)


@pytest.fixture(scope="module")
def targets(tiny_model_dir, tiny_mtp_dir):
    return {"tiny": tiny_model_dir, "tiny-mtp": tiny_mtp_dir}


@pytest.fixture(scope="module")
def tp_prompts(eval_prompts):
    return eval_prompts[:NUM_PROMPTS]


@pytest.fixture(scope="module")
def no_speculation(targets, tp_prompts) -> dict:
    return {name: _run(path, None, tp_prompts) for name, path in targets.items()}


@pytest.fixture(scope="module", params=list(METHODS))
def sharded(request, targets, tiny_eagle3_dir, tp_prompts):
    target, config = METHODS[request.param]
    if isinstance(config, tuple):  # an EAGLE-3 shape on the built-in head, + options
        options = config[2] if len(config) > 2 else {}
        config = {**tree_config(tiny_eagle3_dir, *config[1]), **options}
    pins = DISAGREEING_PINS if config.get("adaptive") else ()
    return request.param, target, _run(targets[target], config, tp_prompts, pins)


def test_every_method_is_exact_and_speculates_on_a_sharded_target(sharded, no_speculation,
                                                                    tp_prompts):
    name, target, ours = sharded
    assert_same_tokens(no_speculation[target]["token_ids"], ours["token_ids"], tp_prompts)
    counts = ours["counts"]
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0, (name, counts)
    if name in PROPOSERS:  # the adaptive controller, on by default, decided on the
        # first rank, which drafted once for both; the second never proposed
        first, second = ours["adaptive"]
        assert first["num_offered"] > 0 and first["num_verified_drafts"] > 0, first
        assert second["num_offered"] == 0, second
    if name == "eagle3_tree16_budget":  # the first rank sized both ranks' trees
        first, second = ours["adaptive"]
        assert first["num_kept"] > 0 and first["num_skipped"] < first["num_steps"], first
        assert second["num_steps"] == 0, second


def test_the_plugin_gave_each_rank_its_cpus(no_speculation):
    """Without a binding of the user's, on a machine with fewer NUMA nodes
    than ranks (this one: vLLM's "auto" would stop the engine) each rank got
    its share of the CPUs; with a node per rank, vLLM's own binding stays."""
    import vllm.utils.cpu_resource_utils as cpu_resources

    cpus = sorted(os.sched_getaffinity(0))
    num_nodes = len(cpu_resources.get_visible_memory_node())
    want = per_rank_cpus(cpus, TP) if num_nodes < TP else None
    assert thread_binding(TP, cpus, num_nodes, None) == want
    assert no_speculation["tiny"]["binding"] == want


def test_a_faulty_proposer_costs_speculation_not_the_sharded_engine(
        tiny_model_dir, tmp_path, tp_prompts, no_speculation, faulty_entry_point):
    """The fault guard at TP=2: `test_faulty` raises on its 4th propose call
    in the first rank's drafter (the one that drafts for both); its guard
    counts it, the step goes on without drafts, and the output stays that of
    no speculation (tests/test_fault_isolation.py: the same at one rank).
    The second rank's proposer is never asked to draft."""
    from tests.proposer_plugins.faulty import PROBE_QUALNAME as FAULT_PROBE

    config = {"method": "test_faulty", "num_speculative_tokens": 3, "fault": "propose_raises",
              "after": 3, "times": 1, "log_file": str(tmp_path / "worker.log")}
    with _unset_binding():
        llm = make_llm(tiny_model_dir, config, tensor_parallel_size=TP,
                       worker_extension_cls=FAULT_PROBE)
        try:
            token_ids = generate(llm, tp_prompts, greedy_params(MAX_TOKENS)).token_ids
            states = llm.collective_rpc("specplug_fault_state")
        finally:
            shutdown_llm(llm)
    assert_same_tokens(no_speculation["tiny"]["token_ids"], token_ids, tp_prompts)
    first, second = states
    assert first["failure_counts"] == {"propose:RuntimeError": 1}, first
    assert not first["disabled"] and first["calls"]["propose"] > 10, first
    assert second["failure_counts"] == {} and second["calls"].get("propose", 0) == 0, second
