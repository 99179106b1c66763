"""Patch of `vllm.config.speculative.SpeculativeConfig.compute_hash`.

Why: vLLM keys its torch.compile cache by the configs that shape the
target's graph, and for speculation that is whether the target returns
auxiliary hidden states (`eagle3` and kin) and which layers. Our methods all
reach vLLM as `method="custom_class"`, so `specplug_ngram` (no auxiliary
outputs) and `specplug_eagle3` (the head's layers) hashed alike: an engine
of one, started where the other had compiled the same target at the same
decode sizes (K=5 chains of both), loaded the other's compiled graph. On 2
GPUs the EAGLE-3 chain then got a plain tensor where Model Runner V2
expects the tuple with the auxiliary states, and failed at start
(docs/results/v2_tensor_parallel_h200x2). vLLM has no hook for the factors
of a custom class: we add our selection's method and options, which name the
head (and so its layers), for our selections only.
"""
from __future__ import annotations

import hashlib

from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.config.speculative"


def _compute_hash(original):
    def compute_hash(self) -> str:
        from vllm_specplug.integration.config import selection_of

        base = original(self)
        selection = selection_of(self)
        if selection is None:
            return base
        ours = f"{base}|{selection.method}|{selection.options_json}".encode()
        return hashlib.sha256(ours).hexdigest()

    return compute_hash


def install() -> list[str]:
    from vllm.config.speculative import SpeculativeConfig

    patch_registry.apply(SpeculativeConfig, "compute_hash",
                         _compute_hash(SpeculativeConfig.compute_hash),
                         reason="torch.compile cache keys that tell vllm-specplug's "
                                "methods apart (auxiliary hidden states or not)")
    return ["patch:SpeculativeConfig.compute_hash"]
