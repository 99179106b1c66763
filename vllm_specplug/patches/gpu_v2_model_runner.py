"""Patches of `vllm.v1.worker.gpu.model_runner` (Model Runner V2, CUDA):
`init_speculator` (as imported there) and two `GPUModelRunner` methods.

Why: Model Runner V2 builds its speculator from a fixed list of methods
(`v1/worker/gpu/spec_decode/__init__.py::init_speculator`) with no registry,
and reports drafts to the scheduler as K placeholders per request. When the
speculative config selects one of our proposers we build our
`SpecplugV2Speculator` instead, and report the true draft lengths: to the
sync scheduler as the drafts themselves (`take_draft_token_ids`), to the
async one on the step output (`sample_tokens`, read by
`SpecplugAsyncScheduler`). Every other method runs vLLM's code untouched.
"""
from __future__ import annotations

from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.v1.worker.gpu.model_runner"


def _ours(runner):
    from vllm_specplug.integration.v2_speculator import SpecplugV2Speculator

    speculator = getattr(runner, "speculator", None)
    return speculator if isinstance(speculator, SpecplugV2Speculator) else None


def _init_speculator(original):
    def init_speculator(vllm_config, device, req_states):
        from vllm_specplug.integration.config import selection_of
        from vllm_specplug.integration.v2_speculator import SpecplugV2Speculator

        if selection_of(vllm_config.speculative_config) is None:
            return original(vllm_config, device, req_states)
        return SpecplugV2Speculator(vllm_config, device, req_states)

    return init_speculator


def _take_draft_token_ids(original):
    def take_draft_token_ids(self):
        speculator = _ours(self)
        if speculator is None:
            return original(self)
        from vllm.v1.outputs import DraftTokenIds

        taken = speculator.take_drafts()
        if taken is None:  # drafted on the device: vLLM's K slots per request
            return original(self)
        req_ids, drafts = taken
        return DraftTokenIds(req_ids, drafts) if req_ids else None

    return take_draft_token_ids


def _sample_tokens(original):
    from vllm_specplug.integration.scheduler import DRAFT_LENGTHS_ATTR

    def sample_tokens(self, grammar_output):
        output = original(self, grammar_output)
        speculator = _ours(self)
        if speculator is None or output is None:
            return output
        lengths = speculator.take_draft_lengths()
        runner_output = getattr(output, "model_runner_output", output)
        if lengths:
            setattr(runner_output, DRAFT_LENGTHS_ATTR, lengths)
        return output

    return sample_tokens


def install() -> list[str]:
    import vllm.v1.worker.gpu.model_runner as module
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    patch_registry.apply(module, "init_speculator", _init_speculator(module.init_speculator),
                         reason="build vllm-specplug's speculator in Model Runner V2")
    patch_registry.apply(GPUModelRunner, "take_draft_token_ids",
                         _take_draft_token_ids(GPUModelRunner.take_draft_token_ids),
                         reason="report vllm-specplug drafts at their true lengths")
    patch_registry.apply(GPUModelRunner, "sample_tokens",
                         _sample_tokens(GPUModelRunner.sample_tokens),
                         reason="draft lengths for SpecplugAsyncScheduler")
    return [f"patch:{MODULE}.init_speculator", "patch:GPUModelRunner(V2).take_draft_token_ids",
            "patch:GPUModelRunner(V2).sample_tokens"]
