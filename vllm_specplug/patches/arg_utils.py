"""Patch of `vllm.engine.arg_utils.EngineArgs.create_speculative_config`.

Why: `SpeculativeConfig.method` is a closed Literal with `extra="forbid"`, so
a method named by our registry cannot pass vLLM's validation, and there is no
hook between the user's dict and that validation. This is the one place both
`LLM(speculative_config=...)` and `vllm serve --speculative-config` go through.
"""
from __future__ import annotations

from vllm_specplug.integration import config as spec_config
from vllm_specplug.patches.registry import patch_registry
from vllm_specplug.proposers.base import ProposerConfigError

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
        try:
            created = original(self, target_model_config, target_parallel_config)
        except NotImplementedError as error:   # vLLM found no MTP layers to serve
            method = raw.get("method") if isinstance(raw, dict) else None
            if method is not None and "mtp" in str(method):
                raise ProposerConfigError(no_mtp_layers(method, target_model_config)) \
                    from error
            raise
        selection = getattr(self, _SAVED_SELECTION, None)
        if created is not None and selection is not None:
            spec_config.attach(created, selection)  # also on a second call
        return created

    return create_speculative_config


def no_mtp_layers(method: str, target_model_config) -> str:
    """vLLM says only "Unsupported speculative method: 'mtp'" for a target
    that ships no MTP layers; say what is wrong and how to get them."""
    arch = (getattr(target_model_config.hf_config, "architectures", None) or ["?"])[0]
    return (f"speculative_config method={method!r}: the target {target_model_config.model} "
            f"({arch}) has no multi-token-prediction layers vLLM can serve (its config "
            "names none, e.g. num_nextn_predict_layers). Serve a model that ships them "
            "(DeepSeek-V3, MiMo, GLM-4.5, Qwen3-Next, ...), or train one for a Llama or "
            "Qwen2 target with `vllm-specplug train-mtp --target MODEL --data DATA --out "
            "DIR` and serve DIR (built-in: `vllm-specplug build-model tiny-mtp`)")


def install() -> list[str]:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    patch_registry.apply(EngineArgs, "create_speculative_config",
                         _create_speculative_config(original),
                         reason="select vllm-specplug proposers by name")
    return ["patch:EngineArgs.create_speculative_config"]
