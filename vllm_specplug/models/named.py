"""Model arguments of our commands: a built-in name, `smollm2`, or a path/hub id."""
from __future__ import annotations

REAL_MODELS = ("smollm2",)


def resolve_model(name: str) -> str:
    """The directory of a built-in or real model by name (built if needed);
    anything else is returned as given (a local directory or a hub id)."""
    from vllm_specplug.models.build import MODEL_SPECS, build_model

    if name in MODEL_SPECS:
        return str(build_model(name))
    if name in REAL_MODELS:
        from vllm_specplug.models.smollm2 import build_smollm2

        return str(build_smollm2())
    return name
