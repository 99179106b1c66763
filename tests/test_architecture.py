"""The one boundary to vLLM's internals: `patches/`, plus modules that
subclass or register with an extension point vLLM offers. Any other module
that imports vLLM's internal packages fails here (the import contracts in
`.importlinter` cover our own layers; this covers vLLM's side)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERNAL = re.compile(r"^\s*(?:from|import) vllm\.(v1|model_executor|attention|distributed|"
                      r"worker|engine|triton_utils|platforms|compilation|forward_context|"
                      r"utils)\b", re.M)
EXTENSION_POINTS = {
    "vllm_specplug/extraction/connector.py": "KV connector base class (kv_transfer_config)",
    "vllm_specplug/extraction/registrar.py": "KVConnectorFactory.register_connector",
    "vllm_specplug/integration/scheduler.py": "Scheduler / AsyncScheduler subclasses (scheduler_cls)",
    "vllm_specplug/integration/batch_schedule.py":
        "Scheduler / AsyncScheduler subclasses (scheduler_cls) in the place of the dynamic "
        "table (num_speculative_tokens_per_batch_size)",
    "vllm_specplug/integration/stat_logger.py":
        "StatLoggerBase subclass (vllm.stat_logger_plugins entry point)",
    "vllm_specplug/integration/v1/kernel_overrides.py": "triton_utils.dispatcher.register_kernels",
    "vllm_specplug/integration/v2/tree_state.py": "Model Runner V2 ModelState subclass",
    "vllm_specplug/integration/v2/draft_confidences.py":
        "the acceptance estimator of vLLM's adaptive verification (enable_adaptive_verification)",
    "vllm_specplug/integration/grammar_drafting.py":
        "vLLM's StructuredOutputManager compiles the drafter's grammars (the backend and "
        "options of structured_outputs_config, as the scheduler's)",
    "vllm_specplug/integration/v2/tree_sampler.py":
        "the rejection sampler a ModelState supplies (custom_sampler)",
    "vllm_specplug/integration/first_rank.py":
        "vLLM's tensor-parallel group (get_tp_group), the collective a sharded model's "
        "own layers use: the first rank's decisions broadcast to the others",
    "vllm_specplug/testing/scheduler_sim.py": "test harness: vLLM's real scheduler classes",
    "vllm_specplug/testing/grammar_async_sim.py":
        "test harness: vLLM's step outputs for its real async scheduler",
    "vllm_specplug/testing/worker_probe.py": "test harness: worker extension",
}
STILL_TO_MOVE = {  # issue 28: behind patches/ or an extension point
    "vllm_specplug/integration/v1/tree_sampler.py": "subclasses vLLM's RejectionSampler",
    # issue 29: the head's replicated embedding on a sharded target all-gathers
    # the shards through vLLM's tensor-parallel group (vllm.distributed)
    "vllm_specplug/integration/head_drafter.py": "all-gathers the target's embedding shards",
}


def test_only_the_boundary_imports_vllm_internals():
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "vllm_specplug").rglob("*.py")
             if INTERNAL.search(p.read_text())}
    outside = {f for f in found if not f.startswith("vllm_specplug/patches/")}
    assert outside == set(EXTENSION_POINTS) | set(STILL_TO_MOVE)


def test_the_boundary_rule_catches_an_internal_import():
    assert INTERNAL.search("x = 1\n    from vllm.v1.worker.gpu_model_runner import X\n")
    assert not INTERNAL.search("from vllm import LLM\nfrom vllm.config import VllmConfig\n")


def import_cycles(package: str = "vllm_specplug") -> list[list[str]]:
    """Every import circle between the package's modules, function-level
    imports included (grimp: the graph import-linter checks), as the shortest
    chain from a module back to one it imports."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.append([importer, *back])
    return cycles


def test_no_module_imports_itself_through_others():
    """Issue 28: dataset <-> repair and tree_greedy <-> tree_verify_triton
    were circles; nothing may close one again."""
    assert import_cycles() == []


def test_the_cycle_check_finds_a_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "circled"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from circled import b\n")
    (pkg / "b.py").write_text("from circled import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("circled") == [["circled.a", "circled.b", "circled.a"],
                                        ["circled.b", "circled.a", "circled.b"]]
