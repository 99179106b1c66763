"""Patch of `vllm.platforms.cpu.CpuPlatform.register_triton_kernel_overrides`.

Why: vLLM's CPU platform registers its C++ replacements of core Triton
kernels at every worker's start, and its `expand_kernel` is broken
(integration/v1/kernel_overrides.py says how). Ours must come after the
platform's, each time: a worker process registers once, but engines whose
core runs in the caller's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)
register again at each engine, and the second engine of a process got the
broken kernel back (mixed greedy and sampled batches stopped matching no
speculation). vLLM's hook is the platform method itself; the patch calls it,
then installs ours.
"""
from __future__ import annotations

from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.platforms.cpu"


def _register(original):
    def register_triton_kernel_overrides(cls) -> None:
        from vllm_specplug.integration.v1 import kernel_overrides

        original.__func__(cls)
        kernel_overrides.install()

    return classmethod(register_triton_kernel_overrides)


def install() -> list[str]:
    from vllm.platforms.cpu import CpuPlatform

    patch_registry.apply(CpuPlatform, "register_triton_kernel_overrides",
                         _register(CpuPlatform.register_triton_kernel_overrides),
                         reason="our CPU expand kernel after the platform's, at every worker")
    return [f"patch:{MODULE}.CpuPlatform.register_triton_kernel_overrides"]
