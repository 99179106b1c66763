"""Patch of `vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager._init_candidates`
(Model Runner V2, CUDA).

Why: with dynamic speculative decoding (`num_speculative_tokens_per_batch_size`)
vLLM captures FULL decode graphs for every query length of the table but
dispatches a token count only to the graphs of the next captured count, so
a decode step whose next graph has another query length runs PIECEWISE
(`integration/cudagraph.add_decode_candidates` says how, with the case
measured). vLLM has no hook for dispatch candidates. The patch keeps vLLM's
candidates and adds, for each token count, the smallest FULL graph of every
other query length; configs with one query length are left as they were.
It serves every method in the engine, vLLM's own included.
"""
from __future__ import annotations

import functools
import logging

from vllm_specplug.patches.registry import patch_registry

MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
logger = logging.getLogger("vllm_specplug.patches")


def _init_candidates(original):
    @functools.wraps(original)
    def init_candidates(self) -> None:
        from vllm.config import CUDAGraphMode

        from vllm_specplug.integration.cudagraph import add_decode_candidates

        original(self)
        full = self._capture_descs.get(CUDAGraphMode.FULL, [])
        added = add_decode_candidates(self._candidates, full, CUDAGraphMode.FULL)
        if added:
            logger.info("vllm-specplug: %d FULL decode-graph candidates added across "
                        "query lengths (dynamic speculative decoding)", added)

    return init_candidates


def install() -> list[str]:
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    patch_registry.apply(CudaGraphManager, "_init_candidates",
                         _init_candidates(CudaGraphManager._init_candidates),
                         reason="FULL decode graphs for every query length of a "
                                "per-batch-size draft table")
    return [f"patch:{MODULE}.CudaGraphManager._init_candidates"]
