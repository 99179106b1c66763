"""Patch of `vllm.v1.worker.gpu.model_states.resolve_model_state_cls`
(Model Runner V2, CUDA).

Why: Model Runner V2 chooses a target's `ModelState` from the model's type
(a model may name its own through `get_model_state_cls`, a plugin cannot).
A tree method (`specplug_eagle3`/`specplug_mtp` with `topk > 1`) needs the
model state that lays out tree steps and verifies trees
(`integration/v2/tree_state.TreeModelState`, a `DefaultModelState`). Every
other config, and targets that need another model state, get vLLM's choice
(trees then stop with a clear error when the target is loaded).
"""
from __future__ import annotations

from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.v1.worker.gpu.model_states"


def wants_tree_state(vllm_config) -> bool:
    from vllm_specplug.integration.config import selection_of
    from vllm_specplug.proposers.eagle3 import TreeProposer
    from vllm_specplug.registry import get_proposer_class

    spec = vllm_config.speculative_config
    selection = selection_of(spec) if spec is not None else None
    if selection is None:
        return False
    cls = get_proposer_class(selection.method)
    return (issubclass(cls, TreeProposer)
            and cls.options_cls.from_dict(selection.method, selection.options).topk > 1)


def _resolve(original):
    def resolve_model_state_cls(vllm_config, model):
        from vllm.v1.worker.gpu.model_states.default import DefaultModelState

        from vllm_specplug.integration.v2.tree_state import TreeModelState

        cls = original(vllm_config, model)
        if cls is DefaultModelState and wants_tree_state(vllm_config):
            return TreeModelState
        return cls

    return resolve_model_state_cls


def install() -> list[str]:
    import vllm.v1.worker.gpu.model_states as module

    patch_registry.apply(module, "resolve_model_state_cls",
                         _resolve(module.resolve_model_state_cls),
                         reason="tree steps of vllm-specplug on Model Runner V2")
    return [f"patch:{MODULE}.resolve_model_state_cls"]
