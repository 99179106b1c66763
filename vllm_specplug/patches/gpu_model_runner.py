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
    from vllm_specplug.integration.v1.drafter import SpecplugDrafter
    from vllm_specplug.integration.v1.tree_drafter import TreeEagleDrafter
    from vllm_specplug.integration.v1.tree_profile import PROFILER

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states, sample_hidden_states,
                                aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, TreeEagleDrafter):
            PROFILER.mark("draft_start")
            drafts = drafter.propose_for_runner(self, scheduler_output, sampled_token_ids,
                                                hidden_states, aux_hidden_states)
            PROFILER.mark("draft_end")
            return drafts
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
    from vllm_specplug.integration.v1.drafter import SpecplugDrafter
    from vllm_specplug.integration.v1.tree_drafter import TreeEagleDrafter

    def on_request_state_removed(self, req_id, req_state):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, (SpecplugDrafter, TreeEagleDrafter)):
            drafter.on_request_removed(req_id)
        return original(self, req_id, req_state)

    return on_request_state_removed


def _prepare_inputs(original):
    from vllm_specplug.integration import cuda_tree_attention
    from vllm_specplug.integration.v1 import tree_step
    from vllm_specplug.integration.v1.tree_drafter import TreeEagleDrafter
    from vllm_specplug.integration.v1.tree_profile import PROFILER

    def prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, TreeEagleDrafter):
            step = tree_step.build_step(self, scheduler_output, drafter.trees)
            drafter.current_step = step
            buffers = drafter.tree_buffers
            if buffers is not None:
                buffers.update(step)
            PROFILER.mark("inputs_ready", len(step.num_computed), step.num_tokens)
        return result

    return prepare_inputs


def _setup_aux_hidden_states(original):
    from vllm.model_executor.models.interfaces import supports_eagle3

    from vllm_specplug.integration import cuda_tree_attention
    from vllm_specplug.integration.v1 import cpu_tree_attention, cuda_tree_buffers
    from vllm_specplug.integration.v1.tree_drafter import TreeEagleDrafter
    from vllm_specplug.integration.v1.tree_sampler import TreeRejectionSampler

    def setup(self):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, TreeEagleDrafter):
            return original(self)
        if drafter.aux_layer_ids is not None:       # EAGLE-3; MTP reads the last layer
            if not supports_eagle3(self.get_model()):
                raise RuntimeError(
                    f"{drafter.method}: the target {type(self.get_model()).__name__} does "
                    "not expose auxiliary hidden states (vLLM's SupportsEagle3 interface)")
            self.use_aux_hidden_state_outputs = True
            self.model.set_aux_hidden_state_layers(drafter.aux_layer_ids)
        self.rejection_sampler = TreeRejectionSampler(
            self.sampler, self.speculative_config, self.device, self)
        layers = self.vllm_config.compilation_config.static_forward_context
        cpu_tree_attention.attach_step_source(layers, drafter)
        if self.device.type == "cuda" and drafter.options.topk > 1:
            drafter.tree_buffers = cuda_tree_buffers.TreeAttentionBuffers(
                self.max_num_reqs, drafter.options.num_draft_tokens, self.device)
            cuda_tree_attention.attach(layers, drafter.tree_buffers)

    return setup


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
    # Tree EAGLE (specplug_eagle3): rope positions = seq_len + depth for tree
    # nodes, which vLLM computes as seq_len + index (its slot mapping, which
    # we keep, is computed in the same function just before).
    patch_registry.apply(GPUModelRunner, "_prepare_inputs",
                         _prepare_inputs(GPUModelRunner._prepare_inputs),
                         reason="tree positions and layout for specplug_eagle3")
    # vLLM enables auxiliary hidden states and builds its chain sampler only
    # for its own eagle3; ours needs tree verification, aux states for
    # EAGLE-3 heads (an MTP layer reads the model output itself) and, on
    # CUDA, the persistent buffers of tree attention (before graph capture).
    patch_registry.apply(GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs",
                         _setup_aux_hidden_states(
                             GPUModelRunner._setup_eagle3_aux_hidden_state_outputs),
                         reason="aux hidden states and tree verification for "
                                "specplug_eagle3")
    return ["patch:GPUModelRunner.propose_draft_token_ids",
            "patch:GPUModelRunner._on_request_state_removed",
            "patch:GPUModelRunner._prepare_inputs",
            "patch:GPUModelRunner._setup_eagle3_aux_hidden_state_outputs"]
