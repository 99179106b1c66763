"""Patch of `vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids`
(the CPU runner inherits it).

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


def install() -> list[str]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    patch_registry.apply(GPUModelRunner, "propose_draft_token_ids",
                         _propose_draft_token_ids(original),
                         reason="give vllm-specplug proposers request ids and lifecycle")
    return ["patch:GPUModelRunner.propose_draft_token_ids"]
