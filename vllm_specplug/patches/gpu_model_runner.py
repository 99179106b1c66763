"""Patches of `vllm.v1.worker.gpu_model_runner.GPUModelRunner` (the CPU runner
inherits them): `propose_draft_token_ids`, `_on_request_state_removed`,
`_prepare_inputs`, `sample_tokens` and `_setup_eagle3_aux_hidden_state_outputs`.

Why: the `custom_class` route calls `drafter.propose(sampled, num_tokens,
token_ids)` with no request ids, no finished/preempted requests and no hidden
states, so no per-request lifecycle is possible. When the drafter is ours, we
hand it the runner and scheduler output instead; every other method runs
vLLM's code untouched. Each patch asks one thing, whether the runner's
drafter is ours, and calls the drafter's hook (`integration/v1/hooks.py`).
"""
from __future__ import annotations

from vllm_specplug.patches.registry import patch_registry


def _ours(runner):
    """The runner's drafter when it is a vllm-specplug one, else None."""
    from vllm_specplug.integration.v1.hooks import V1DrafterHooks

    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, V1DrafterHooks) else None


def _propose_draft_token_ids(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states, sample_hidden_states,
                                aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        drafter = _ours(self)
        if drafter is None:
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states,
                            spec_decode_metadata, common_attn_metadata, slot_mappings)
        if not (drafter.drafts_on_every_rank or _drafts_reach_scheduler()):
            return drafter.no_drafts(self)
        outputs = {"hidden_states": hidden_states, "aux_hidden_states": aux_hidden_states,
                   "sample_hidden_states": sample_hidden_states,
                   "spec_decode_metadata": spec_decode_metadata}
        return drafter.propose_for_runner(self, scheduler_output, sampled_token_ids, outputs)

    return propose_draft_token_ids


def _drafts_reach_scheduler() -> bool:
    """Whether this worker's drafts reach the scheduler: vLLM reads the step
    output of the first rank of the tensor-parallel group only, and hands its
    drafts to every rank with the next scheduler output."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().is_first_rank


def _on_request_state_removed(original):
    def on_request_state_removed(self, req_id, req_state):
        drafter = _ours(self)
        if drafter is not None:
            drafter.on_request_removed(req_id)
        return original(self, req_id, req_state)

    return on_request_state_removed


def _prepare_inputs(original):
    def prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        drafter = _ours(self)
        if drafter is not None:
            drafter.observe_schedule(scheduler_output)
            drafter.after_prepare_inputs(self, scheduler_output)
            if _plain_step(self, drafter, scheduler_output, result):
                # (logits_indices, spec_decode_metadata, max_num_sampled_tokens)
                return result[0], None, 1
        return result

    return prepare_inputs


def _plain_step(runner, drafter, scheduler_output, result) -> bool:
    """Whether this step samples as one without speculation: it verifies no
    draft at all, its drafter does not need the verification metadata, and
    no layer is recurrent (vLLM counts such a step as speculative rows of
    zero drafts for recurrent state offsets). vLLM's V1 runner otherwise runs
    its rejection sampler over zero drafts: on CPU (tiny model, batch 16) a
    step at the batch policy's K = 0 took 6.4 ms where no speculation's took
    5.0, 0.25 ms of it in that sampler. The logits rows are the same (one
    per request, at its last token), and so is the token: the target's
    sample there. vLLM has already built the metadata (0.1 ms here); it is
    dropped rather than rebuilt around, so vLLM's own code stays whole."""
    return (drafter.plain_steps_without_drafts and result[1] is not None
            and not scheduler_output.scheduled_spec_decode_tokens
            and not getattr(runner.model_config, "is_hybrid", False))


def _take_draft_token_ids(original):
    from vllm_specplug.integration.grammar_trees import TREE_PARENTS_ATTR

    def take_draft_token_ids(self):
        drafts = original(self)
        drafter = _ours(self)
        if drafts is not None and drafter is not None:
            parents = drafter.draft_tree_parents()
            if parents:
                setattr(drafts, TREE_PARENTS_ATTR,
                        {r: parents[r] for r in drafts.req_ids if r in parents})
        return drafts

    return take_draft_token_ids


def _sample_tokens(original):
    from vllm_specplug.integration.batch_schedule import PATH_RANKS_ATTR

    def sample_tokens(self, grammar_output):
        drafter = _ours(self)
        choices = getattr(drafter, "tree_choices", None)
        if choices is not None:  # greedy trees left unmasked (v1/tree_choices.py)
            grammar_output = choices.begin(grammar_output)
        output = original(self, grammar_output)
        take = getattr(drafter, "take_path_ranks", None)  # tree drafters only
        path_ranks = take() if take is not None and output is not None else None
        if path_ranks is not None:
            setattr(getattr(output, "model_runner_output", output), PATH_RANKS_ATTR, path_ranks)
        return output

    return sample_tokens


def _setup_aux_hidden_states(original):
    from vllm.model_executor.models.interfaces import supports_eagle3

    def setup(self):
        drafter = _ours(self)
        if drafter is None:
            return original(self)
        return drafter.setup_runner(self, lambda: original(self),
                                    supports_eagle3(self.get_model()))

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
    # our batch policy learns every smaller tree size from a tree step's
    # accepted paths, which ride on the step's output to the scheduler
    patch_registry.apply(GPUModelRunner, "sample_tokens",
                         _sample_tokens(GPUModelRunner.sample_tokens),
                         reason="accepted paths' node ranks to our batch policy")
    patch_registry.apply(GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs",
                         _setup_aux_hidden_states(
                             GPUModelRunner._setup_eagle3_aux_hidden_state_outputs),
                         reason="aux hidden states and tree verification for "
                                "specplug_eagle3")
    # The scheduler checks a grammar per tree node (grammar_trees.py): it
    # needs the trees' parents, which travel with the drafts.
    patch_registry.apply(GPUModelRunner, "take_draft_token_ids",
                         _take_draft_token_ids(GPUModelRunner.take_draft_token_ids),
                         reason="tree parents for grammar-aware draft trees")
    return ["patch:GPUModelRunner.propose_draft_token_ids",
            "patch:GPUModelRunner.take_draft_token_ids",
            "patch:GPUModelRunner._on_request_state_removed",
            "patch:GPUModelRunner._prepare_inputs",
            "patch:GPUModelRunner._setup_eagle3_aux_hidden_state_outputs"]
