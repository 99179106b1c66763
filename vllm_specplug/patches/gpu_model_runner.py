"""Patches of `vllm.v1.worker.gpu_model_runner.GPUModelRunner` (the CPU runner
inherits both): `propose_draft_token_ids` and `_on_request_state_removed`.

Why: the `custom_class` route calls `drafter.propose(sampled, num_tokens,
token_ids)` with no request ids, no finished/preempted requests and no hidden
states, so no per-request lifecycle is possible. When the drafter is ours, we
hand it the runner and scheduler output instead; every other method runs
vLLM's code untouched.
"""
from __future__ import annotations

from vllm_specplug.patches.registry import patch_registry


def _propose_draft_token_ids(original):
    from vllm_specplug.integration.drafter import SpecplugDrafter

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states, sample_hidden_states,
                                aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, SpecplugDrafter):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states,
                            spec_decode_metadata, common_attn_metadata, slot_mappings)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return drafter.propose_for_runner(self, scheduler_output, sampled_token_ids,
                                          sample_hidden_states, spec_decode_metadata)

    return propose_draft_token_ids


def _on_request_state_removed(original):
    from vllm_specplug.integration.drafter import SpecplugDrafter

    def on_request_state_removed(self, req_id, req_state):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecplugDrafter):
            drafter.on_request_removed(req_id)
        return original(self, req_id, req_state)

    return on_request_state_removed


def install() -> list[str]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patch_registry.apply(GPUModelRunner, "propose_draft_token_ids",
                         _propose_draft_token_ids(GPUModelRunner.propose_draft_token_ids),
                         reason="give vllm-specplug proposers request ids and lifecycle")
    # vLLM's documented per-request clean-up hook; it runs for finished and
    # aborted requests even in steps that schedule nothing (no drafting).
    patch_registry.apply(GPUModelRunner, "_on_request_state_removed",
                         _on_request_state_removed(GPUModelRunner._on_request_state_removed),
                         reason="tell vllm-specplug proposers a request finished")
    return ["patch:GPUModelRunner.propose_draft_token_ids",
            "patch:GPUModelRunner._on_request_state_removed"]
