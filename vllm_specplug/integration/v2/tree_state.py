"""The model state of a tree step on Model Runner V2.

Model Runner V2 delegates what is specific to a model to a `ModelState`
(vllm/v1/worker/gpu/model_states/): attention metadata, extra model inputs,
KV-cache hooks and, through `custom_sampler`, the rejection sampler. A tree
method's target runs under `TreeModelState`, vLLM's `DefaultModelState` plus:

- `prepare_attn`: after vLLM built the metadata (and computed the KV slots
  from sequential positions), the step's tree rows are laid out on the
  device (`verification/tree_rows.prepare_tree_rows`): rope positions become
  `seq_len + depth`, and the rows our tree-attention kernel reads inside the
  (captured) forward are written. The block table is kept for KV compaction.
- `initialize_kv_cache`: every attention layer's cache, for KV compaction.
- `custom_sampler`: the tree sampler (tree_sampler.py).

The patch of `resolve_model_state_cls` (patches/gpu_v2_model_states.py)
picks it for tree methods; the speculator binds its `TreeSlots` when the
target is loaded.
"""
from __future__ import annotations

from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from vllm_specplug.integration.v2.tree_sampler import V2TreeRejectionSampler
from vllm_specplug.integration.v2.tree_slots import TreeSlots
from vllm_specplug.verification.tree_rows import prepare_tree_rows


class TreeModelState(DefaultModelState):
    tree_slots: TreeSlots | None = None
    grammar_choices = None  # GrammarChoices of grammar_verify "choices", else None

    def bind(self, tree_slots: TreeSlots, grammar_choices=None) -> None:
        self.tree_slots = tree_slots
        self.grammar_choices = grammar_choices

    def custom_sampler(self, sampler):
        from vllm_specplug.integration.scheduler import masks_rows_per_node

        return sampler, V2TreeRejectionSampler(
            sampler, self,
            grammar_rows_per_node=masks_rows_per_node(self.vllm_config.scheduler_config))

    def initialize_kv_cache(self, kv_cache_config, block_tables) -> None:
        super().initialize_kv_cache(kv_cache_config, block_tables)
        if self.tree_slots is None:
            raise RuntimeError("TreeModelState: no tree slots bound before the KV cache "
                               "(the vllm-specplug speculator was not loaded)")
        layers = self.vllm_config.compilation_config.static_forward_context.values()
        self.tree_slots.bind_kv_caches([layer.kv_cache for layer in layers
                                        if hasattr(layer, "impl") and hasattr(layer, "kv_cache")])

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings,
                     attn_groups, kv_cache_config, for_capture: bool = False,
                     ubatch_idx: int = 0, **kwargs):
        metadata = super().prepare_attn(input_batch, cudagraph_mode, block_tables,
                                        slot_mappings, attn_groups, kv_cache_config,
                                        for_capture, ubatch_idx, **kwargs)
        if self.tree_slots is not None:
            self._lay_out_trees(input_batch, block_tables)
        return metadata

    def _lay_out_trees(self, input_batch, block_tables) -> None:
        slots = self.tree_slots
        slots.block_table = block_tables[0]
        if input_batch.num_draft_tokens == 0:  # no tree this step: clear once, then skip
            if slots.num_masked:
                slots.metadata.num_nodes.zero_()
                slots.num_masked = 0
            return
        prepare_tree_rows(input_batch.positions, input_batch.query_start_loc,
                          input_batch.cu_num_logits, input_batch.idx_mapping,
                          input_batch.num_reqs, slots.is_tree, slots.depths, slots.bits,
                          slots.metadata)
        drafted = input_batch.num_draft_tokens_per_req
        slots.num_masked = input_batch.num_reqs if drafted is None else int((drafted > 0).sum())
        slots.masked_steps += bool(slots.num_masked)
