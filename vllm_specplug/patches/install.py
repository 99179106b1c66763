"""Registrar run by the plugin: installs every patch (each one waits for the
vLLM module it patches to be imported) and reports the registered proposer
names. It lives here, not in `proposers/`: proposers never touch vLLM."""
from __future__ import annotations

from vllm_specplug.patches import (arg_utils, config_speculative, config_vllm, cpu_attn,
                                   flash_attn, gpu_model_runner, gpu_v2_cudagraph_utils,
                                   gpu_v2_model_runner, gpu_v2_model_states, platforms_cpu,
                                   triton_attn)
from vllm_specplug.patches.lazy import when_imported
from vllm_specplug.registry import available_proposers

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def register_proposers() -> list[str]:
    items = arg_utils.install() + config_vllm.install() + config_speculative.install()
    # Only workers import the model runner; patch it there, when they do.
    when = when_imported(RUNNER_MODULE, gpu_model_runner.install)
    items.append(f"patch:{RUNNER_MODULE} ({when})")
    # Our CPU kernels after the platform's, each time a worker registers those.
    when_imported(platforms_cpu.MODULE, platforms_cpu.install)
    when_imported(cpu_attn.MODULE, cpu_attn.install)
    for backend in (flash_attn, triton_attn):  # CUDA tree attention
        when_imported(backend.MODULE, backend.install)
    # Model Runner V2 (CUDA only; never imported on the CPU platform).
    when_imported(gpu_v2_model_runner.MODULE, gpu_v2_model_runner.install)
    when_imported(gpu_v2_model_states.MODULE, gpu_v2_model_states.install)
    when_imported(gpu_v2_cudagraph_utils.MODULE, gpu_v2_cudagraph_utils.install)
    return items + [f"proposer:{name}" for name in available_proposers()]
