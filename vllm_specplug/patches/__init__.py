"""The only place that touches vLLM internals.

One module per vLLM module patched; every patch goes through `registry.apply`.
"""
from vllm_specplug.patches.registry import (PatchConflict, PatchRecord,
                                            PatchRegistry, patch_registry)

__all__ = ["PatchConflict", "PatchRecord", "PatchRegistry", "patch_registry"]
