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

    def specplug_break_tree_verifier(self) -> str:
        """Swap this worker's tree sampler for one that accepts every first
        child (a deliberately wrong verifier: the distribution tests must
        catch it). Returns the class now in place."""
        from vllm_specplug.integration.tree_sampler import TreeRejectionSampler

        runner = self.model_runner
        if not isinstance(runner.rejection_sampler, TreeRejectionSampler):
            raise RuntimeError("this engine does not run specplug_eagle3")
        broken = _always_accept_class()
        runner.rejection_sampler.__class__ = broken
        return broken.__name__


def _always_accept_class():
    from vllm_specplug.integration.tree_sampler import TreeRejectionSampler

    class AlwaysAcceptFirstChild(TreeRejectionSampler):
        @staticmethod
        def random_samples(batch, width, vocab, sampling_metadata, device):
            uniform, exp = TreeRejectionSampler.random_samples(
                batch, width, vocab, sampling_metadata, device)
            return uniform.zero_(), exp  # u = 0 accepts any child the target allows

    return AlwaysAcceptFirstChild

