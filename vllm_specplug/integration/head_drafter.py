"""A tree method's drafter as both model runners drive it.

`specplug_eagle3` and `specplug_mtp` draft EAGLE-2 trees with a one-layer
drafter (an EAGLE-3 head, or the target's MTP layer) run by `HeadRuntime`
(proposers/eagle3_head.py). What does not depend on the runner lives here,
once: the selection and its options, the fault guard, loading the drafter
(the proposer class says how: `load_drafter`), the drafter's dtype and CUDA
graphs, and the runtime, made when the target is loaded (it borrows the
target's token embedding, as vLLM's eagle3 does). The two runner adapters
only translate their runner's batch state into the runtime's calls:
`tree_drafter.py` (V1 runner, CPU) and `v2/head_speculator.py` (Model Runner
V2, CUDA).
"""
from __future__ import annotations

import logging

import torch

from vllm_specplug.integration.config import selection_of
from vllm_specplug.integration.guard import ProposerGuard
from vllm_specplug.proposers.eagle3 import AUTO_DRAFT_COMPILE
from vllm_specplug.proposers.eagle3_head import HeadRuntime
from vllm_specplug.registry import get_proposer_class

logger = logging.getLogger("vllm_specplug.tree_drafter")


def token_embedding(target_model):
    """The target's token embedding as the drafter calls it: [N] ids -> [N, H].

    One rank: the target's own module. On a sharded target (TP > 1) a
    replicated copy, the ranks' vocabulary shards all-gathered once here: the
    target's `VocabParallelEmbedding` all-reduces on every call, and the
    drafter's passes run in CUDA graphs of our own, captured outside vLLM's
    `graph_capture()` where the custom all-reduce registers its buffers (on
    2 GPUs the first drafting step then faulted, docs/results/
    v2_tensor_parallel_h200x2). Costs vocab x hidden more weights a rank
    (SmolLM2 57 MB in bf16, Llama-3-8B 1 GB)."""
    from vllm.distributed import (get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_gather)

    if get_tensor_model_parallel_world_size() == 1:
        return target_model.embed_input_ids
    module = target_model.get_language_model().model.embed_tokens \
        if hasattr(target_model, "get_language_model") else target_model.model.embed_tokens
    if getattr(module, "num_added_embeddings", 0):
        raise ValueError("vllm-specplug: a sharded target with added vocabulary (LoRA "
                         "extra tokens) is not supported by the tree drafter; serve it "
                         "with tensor_parallel_size=1 or without the added tokens")
    weight = tensor_model_parallel_all_gather(module.weight.data, dim=0)
    weight = weight[:module.org_vocab_size].contiguous()
    return lambda input_ids: torch.nn.functional.embedding(input_ids, weight)


class HeadDrafter:
    def __init__(self, vllm_config) -> None:
        selection = selection_of(vllm_config.speculative_config)
        if selection is None:
            raise RuntimeError("vllm-specplug tree drafter created without a proposer "
                               "selection: the plugin must be loaded in the front end")
        self.method = selection.method
        self.adaptive = selection.adaptive  # "on": per-step tree sizes (adaptive/tree_budget.py)
        proposer_cls = get_proposer_class(self.method)
        self.options = proposer_cls.options_cls(**selection.options)
        self.device = torch.device(str(vllm_config.device_config.device))
        self.cuda_graphs = (self.device.type == "cuda" and self.options.draft_cudagraph
                            and not vllm_config.model_config.enforce_eager)
        # "auto" compiles where the passes are graphs: there the compiled
        # steps serve captures only (proposers/draft_compile.py)
        self.compiles = self.options.draft_compile is True or (
            self.options.draft_compile == AUTO_DRAFT_COMPILE and self.cuda_graphs)
        self.draft_dtype = (vllm_config.model_config.dtype if self.options.draft_dtype == "auto"
                            else getattr(torch, self.options.draft_dtype))
        self.guard = ProposerGuard(self.method, selection.max_proposer_failures)
        self.loaded = proposer_cls.load_drafter(self.options, vllm_config.model_config.model)
        self.runtime: HeadRuntime | None = None
        logger.info("vllm-specplug %s: %s, topk=%d num_steps=%d num_draft_tokens=%d, %s",
                    self.method, self.loaded.description, self.options.topk,
                    self.options.num_steps, self.options.num_draft_tokens, self.draft_dtype)

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        """Target layers the drafter reads (None: the last hidden state)."""
        return self.loaded.aux_layer_ids

    @property
    def is_tree(self) -> bool:
        return self.options.topk > 1

    @property
    def tree_shape(self) -> tuple[int, int, int]:
        return self.options.topk, self.options.num_steps, self.options.num_draft_tokens

    def load_model(self, target_model, num_slots: int) -> HeadRuntime:
        """The runtime on the device, sharing the target's token embedding."""
        layer = self.loaded.build(self.device, self.draft_dtype)
        self.runtime = HeadRuntime(layer, token_embedding(target_model),
                                   self.options.draft_temperature, num_slots=num_slots,
                                   cuda_graphs=self.cuda_graphs,
                                   attention_backend=self.options.draft_attention,
                                   compile_steps=self.compiles)
        return self.runtime

    def target_hidden(self, hidden_states, aux_hidden_states, rows, out=None):
        return self.loaded.target_hidden(hidden_states, aux_hidden_states, rows, out)

    def target_layout(self, hidden_states, aux_hidden_states) -> tuple[int, torch.dtype]:
        """Features per row of `target_hidden`, and their dtype."""
        sources = self.loaded.target_sources(hidden_states, aux_hidden_states)
        if sources is None:
            raise RuntimeError(f"{self.method}: the target's runner produced no hidden "
                               "states for the drafter")
        return sum(s.shape[-1] for s in sources), sources[0].dtype
