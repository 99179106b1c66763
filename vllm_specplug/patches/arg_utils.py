"""Patch of `vllm.engine.arg_utils.EngineArgs.create_speculative_config`.

Why: `SpeculativeConfig.method` is a closed Literal with `extra="forbid"`, so
a method named by our registry cannot pass vLLM's validation, and there is no
hook between the user's dict and that validation. This is the one place both
`LLM(speculative_config=...)` and `vllm serve --speculative-config` go through.
"""
from __future__ import annotations

from vllm_specplug.integration import config as spec_config
from vllm_specplug.patches.registry import patch_registry

_SAVED_SELECTION = "_specplug_selection"


def _create_speculative_config(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        raw = self.speculative_config
        if isinstance(raw, dict):
            raw = {k.replace("-", "_"): v for k, v in raw.items()}
            translated = spec_config.translate(raw)
            if translated is not None:
                self.speculative_config, selection = translated
                spec_config.check_target(selection, target_model_config.hf_config)
                setattr(self, _SAVED_SELECTION, selection)
        created = original(self, target_model_config, target_parallel_config)
        selection = getattr(self, _SAVED_SELECTION, None)
        if created is not None and selection is not None:
            spec_config.attach(created, selection)  # also on a second call
        return created

    return create_speculative_config


def install() -> list[str]:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    patch_registry.apply(EngineArgs, "create_speculative_config",
                         _create_speculative_config(original),
                         reason="select vllm-specplug proposers by name")
    return ["patch:EngineArgs.create_speculative_config"]
