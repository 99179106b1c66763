"""Registrar run by the plugin: installs the proposer patches and reports the
registered proposer names."""
from __future__ import annotations

from vllm_specplug.patches import arg_utils, gpu_model_runner
from vllm_specplug.registry import available_proposers


def register_proposers() -> list[str]:
    items = arg_utils.install() + gpu_model_runner.install()
    return items + [f"proposer:{name}" for name in available_proposers()]
