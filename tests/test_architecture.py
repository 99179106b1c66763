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
    "vllm_specplug/integration/scheduler.py": "AsyncScheduler subclass (scheduler_cls)",
    "vllm_specplug/integration/v1/kernel_overrides.py": "triton_utils.dispatcher.register_kernels",
    "vllm_specplug/integration/v2/tree_state.py": "Model Runner V2 ModelState subclass",
    "vllm_specplug/integration/v2/tree_sampler.py":
        "the rejection sampler a ModelState supplies (custom_sampler)",
    "vllm_specplug/testing/scheduler_sim.py": "test harness: vLLM's real scheduler classes",
    "vllm_specplug/testing/worker_probe.py": "test harness: worker extension",
}
STILL_TO_MOVE = {  # issue 28: behind patches/ or an extension point
    "vllm_specplug/integration/v1/tree_sampler.py": "subclasses vLLM's RejectionSampler",
}


def test_only_the_boundary_imports_vllm_internals():
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "vllm_specplug").rglob("*.py")
             if INTERNAL.search(p.read_text())}
    outside = {f for f in found if not f.startswith("vllm_specplug/patches/")}
    assert outside == set(EXTENSION_POINTS) | set(STILL_TO_MOVE)


def test_the_boundary_rule_catches_an_internal_import():
    assert INTERNAL.search("x = 1\n    from vllm.v1.worker.gpu_model_runner import X\n")
    assert not INTERNAL.search("from vllm import LLM\nfrom vllm.config import VllmConfig\n")
