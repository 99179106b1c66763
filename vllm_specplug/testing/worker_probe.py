"""A worker extension that reports, from inside a worker process, whether our
plugin registered there.

Use with `LLM(..., worker_extension_cls=PROBE_QUALNAME)` and
`llm.collective_rpc("specplug_registration_state")`. vLLM only logs a plugin's
exception, so this is how a test can fail when `register()` breaks.
"""
from __future__ import annotations

PROBE_QUALNAME = "vllm_specplug.testing.worker_probe.SpecplugProbe"


class SpecplugProbe:
    def specplug_registration_state(self) -> dict:
        from vllm_specplug.plugin import registration_state

        return registration_state()

    def specplug_kernel_override(self, name: str) -> str | None:
        """Qualified name of the implementation vLLM's kernel dispatcher
        routes `name` to in this worker (None: the original kernel)."""
        from vllm.triton_utils import dispatcher

        entry = dispatcher._registry.get(name)
        return None if entry is None else f"{entry[1].__module__}.{entry[1].__qualname__}"
