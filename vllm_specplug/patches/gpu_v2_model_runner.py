"""Patches of `vllm.v1.worker.gpu.model_runner` (Model Runner V2, CUDA):
`init_speculator` (as imported there) and four `GPUModelRunner` methods.

Why: Model Runner V2 builds its speculator from a fixed list of methods
(`v1/worker/gpu/spec_decode/__init__.py::init_speculator`) with no registry,
and reports drafts to the scheduler as K placeholders per request. When the
speculative config selects one of our proposers we build ours instead:
`SpecplugV2Speculator` for model-free proposers, `SpecplugV2HeadSpeculator`
for tree methods (`specplug_eagle3`, `specplug_mtp`), and keeps the
requests' token histories in GPU memory where ours scan them there, as vLLM
does for its own n-gram (integration/v2/token_history.py). For the first we report
the true draft lengths: to the sync scheduler as the drafts themselves
(`take_draft_token_ids`), to the async one on the step output
(`sample_tokens`, read by `SpecplugAsyncScheduler`), and before a tree
head's step samples, the rows of its constrained requests that the
scheduler left to the worker are filled (`sample_tokens`,
integration/worker_rows.py); trees go to the
scheduler with their parents (`take_draft_token_ids`, for the grammar check
of `SpecplugTreeAsyncScheduler`). The second needs the
target: `load_model` hands it over once loaded (vLLM does so only for its own
`DraftModelSpeculator`s) and switches on the target's auxiliary hidden states
for EAGLE-3 heads (vLLM decides that from a fixed list of methods), and
`execute_model` shows it each scheduler output before the runner applies it
(the KV block ids its head cache follows for prefix-cache hits; the runner
has no hook for that). Every other method runs vLLM's code untouched.
"""
from __future__ import annotations

from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.v1.worker.gpu.model_runner"


def _ours(runner):
    from vllm_specplug.integration.v2.speculator import SpecplugV2Speculator

    speculator = getattr(runner, "speculator", None)
    return speculator if isinstance(speculator, SpecplugV2Speculator) else None


def _init_speculator(original):
    def init_speculator(vllm_config, device, req_states):
        from vllm_specplug.integration.config import selection_of
        from vllm_specplug.integration.first_rank import first_rank_share
        from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
        from vllm_specplug.integration.v2.speculator import SpecplugV2Speculator
        from vllm_specplug.integration.v2.token_history import place_token_histories
        from vllm_specplug.proposers.eagle3 import TreeProposer
        from vllm_specplug.registry import get_proposer_class

        selection = selection_of(vllm_config.speculative_config)
        if selection is None:
            return original(vllm_config, device, req_states)
        if issubclass(get_proposer_class(selection.method), TreeProposer):
            speculator = SpecplugV2HeadSpeculator(vllm_config, device, req_states)
        else:
            speculator = SpecplugV2Speculator(vllm_config, device, req_states,
                                              shared=first_rank_share(vllm_config))
        # before any request is added (RequestState was made just before)
        place_token_histories(req_states, device, selection.token_history,
                              speculator.scans_token_histories, _dense_token_buffer)
        return speculator

    return init_speculator


def _dense_token_buffer(shape: tuple[int, int], dtype, device):
    """vLLM's token-history buffer in GPU memory, as it makes it for its own
    n-gram (`uva_instead_of_gpu=False`; integration/v2/token_history.py)."""
    from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor

    return StagedWriteTensor(shape, dtype=dtype, device=device, uva_instead_of_gpu=False)


def _take_draft_token_ids(original):
    def take_draft_token_ids(self):
        speculator = _ours(self)
        if speculator is None:
            return _with_tree_parents(self, original(self))
        from vllm.v1.outputs import DraftTokenIds

        taken = speculator.take_drafts()
        if taken is None:  # drafted on the device: vLLM's K slots per request
            return original(self)
        req_ids, drafts = taken
        return DraftTokenIds(req_ids, drafts) if req_ids else None

    return take_draft_token_ids


def _with_tree_parents(runner, drafts):
    """Our trees' drafts go to the scheduler with each tree's parents, for
    its grammar check per node (`SpecplugTreeAsyncScheduler`)."""
    from vllm_specplug.integration.grammar_trees import TREE_PARENTS_ATTR
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator

    speculator = getattr(runner, "speculator", None)
    if drafts is None or not isinstance(speculator, SpecplugV2HeadSpeculator):
        return drafts
    parents = speculator.take_tree_parents()
    if parents:
        setattr(drafts, TREE_PARENTS_ATTR,
                {req_id: parents[req_id] for req_id in drafts.req_ids if req_id in parents})
    return drafts


def _sample_tokens(original):
    from vllm_specplug.integration.batch_schedule import PATH_RANKS_ATTR
    from vllm_specplug.integration.scheduler import DRAFT_LENGTHS_ATTR

    def sample_tokens(self, grammar_output):
        from vllm_specplug.integration.v2.speculator import V2SpeculatorHooks

        speculator = getattr(self, "speculator", None)
        if getattr(speculator, "rows_in_worker", False):  # tree heads: worker_rows.py
            grammar_output = speculator.verification_rows(self, grammar_output)
        output = original(self, grammar_output)
        # either of ours: the model-free one reports its draft lengths, the
        # head's trees their accepted paths' ranks (was: the model-free one
        # only, so no tree's paths reached the batch policy on the GPU)
        if not isinstance(speculator, V2SpeculatorHooks) or output is None:
            return output
        runner_output = getattr(output, "model_runner_output", output)
        take_lengths = getattr(speculator, "take_draft_lengths", None)  # model-free
        lengths = take_lengths() if take_lengths is not None else None
        if lengths:
            setattr(runner_output, DRAFT_LENGTHS_ATTR, lengths)
        take_ranks = getattr(speculator, "take_path_ranks", None)  # tree heads only
        path_ranks = take_ranks() if take_ranks is not None else None
        if path_ranks is not None:
            setattr(runner_output, PATH_RANKS_ATTR, path_ranks)
        return output

    return sample_tokens


def _load_model(original):
    def load_model(self, *args, **kwargs):
        from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator

        result = original(self, *args, **kwargs)
        speculator = getattr(self, "speculator", None)
        if isinstance(speculator, SpecplugV2HeadSpeculator):
            if speculator.aux_layer_ids is not None:
                _set_aux_layers(self, speculator.method, speculator.aux_layer_ids)
            speculator.attach(self.model, self.model_state,
                              self.vllm_config.compilation_config.static_forward_context)
        return result

    return load_model


def _execute_model(original):
    def execute_model(self, scheduler_output, *args, **kwargs):
        from vllm_specplug.integration.v2.speculator import V2SpeculatorHooks

        speculator = getattr(self, "speculator", None)
        if isinstance(speculator, V2SpeculatorHooks) and not kwargs.get("dummy_run", False):
            speculator.observe_schedule(scheduler_output)
            speculator.schedule(scheduler_output, self.req_states)
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def _set_aux_layers(runner, method: str, layer_ids: tuple[int, ...]) -> None:
    """The target returns the hidden states of `layer_ids` beside its output
    (vLLM's `SupportsEagle3`), and the runner unpacks them."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    if not supports_eagle3(runner.model):
        raise RuntimeError(f"{method}: the target {type(runner.model).__name__} does not "
                           "expose auxiliary hidden states (vLLM's SupportsEagle3 interface)")
    runner.model.set_aux_hidden_state_layers(layer_ids)
    runner.use_aux_hidden_state_outputs = True


def install() -> list[str]:
    import vllm.v1.worker.gpu.model_runner as module
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    patch_registry.apply(module, "init_speculator", _init_speculator(module.init_speculator),
                         reason="build vllm-specplug's speculator in Model Runner V2")
    patch_registry.apply(GPUModelRunner, "take_draft_token_ids",
                         _take_draft_token_ids(GPUModelRunner.take_draft_token_ids),
                         reason="report vllm-specplug drafts at their true lengths, "
                                "trees with their parents")
    patch_registry.apply(GPUModelRunner, "sample_tokens",
                         _sample_tokens(GPUModelRunner.sample_tokens),
                         reason="draft lengths for SpecplugAsyncScheduler; constrained "
                                "steps' rows filled in the worker")
    patch_registry.apply(GPUModelRunner, "load_model", _load_model(GPUModelRunner.load_model),
                         reason="hand the target to vllm-specplug's tree drafter")
    patch_registry.apply(GPUModelRunner, "execute_model",
                         _execute_model(GPUModelRunner.execute_model),
                         reason="the scheduler's block ids for vllm-specplug's head cache "
                                "(prefix-cache hits)")
    return [f"patch:{MODULE}.init_speculator", "patch:GPUModelRunner(V2).take_draft_token_ids",
            "patch:GPUModelRunner(V2).sample_tokens", "patch:GPUModelRunner(V2).load_model",
            "patch:GPUModelRunner(V2).execute_model"]
