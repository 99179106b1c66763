"""Tree verification on Model Runner V2, then KV compaction.

The model state hands this to the runner as its rejection sampler
(`ModelState.custom_sampler`, tree_state.py). It is called with vLLM's
logits, one row per tree node (root first) of each request that verifies a
tree and one row for the others, in `cu_num_logits` layout. Each request
becomes a tree from its state slot's parents (`TreeSlots`; nodes past what
was scheduled, or past what its last tree had, are cut) and goes through our greedy (temperature 0) or
stochastic (SpecInfer-style "target only", lossless) tree verification.
Stochastic requests take their randomness from their vLLM seed and the
root's position, so a seeded request reproduces its output. The output has
vLLM's layout ([B, N] tokens: the accepted path then the bonus token), so
`post_update`, the scheduler and the metrics read it as they read chains.

Accepted paths are kept for the drafter's ingest, and each path's K/V moves
from the node's slot (`seq_len + node`) to `seq_len + depth` in every layer,
with the compaction kernel `kernels/kv_compaction.py`.

Batches whose sampling needs vLLM's full sampler on every row (logprobs,
logits processors: penalties, bad words, logit bias, min tokens, thinking
budgets; grammars; sampling masks) accept no drafts this step: vLLM's own
sampler samples each request's root row (lossless; only speculation is lost).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from vllm_specplug.verification.backend import to_device
from vllm_specplug.verification.kv_compaction import compact_kv_cache, compact_kv_layers
from vllm_specplug.verification.metadata import NO_NODE, DraftTree
from vllm_specplug.verification.seeded_random import seeded_uniform
from vllm_specplug.verification.tree_greedy_rows import node_rows, verify_tree_greedy_rows
from vllm_specplug.verification.tree_sampling import verify_tree_stochastic

EMPTY = torch.empty(0, dtype=torch.int64)


def sampling_params_need_processing(states, idx_mapping_np: np.ndarray) -> np.ndarray:
    """[B] bool: vLLM's `SamplingStates.add_request` verdict for temperature,
    min_p, top-k and top-p alone (what tree verification applies itself)."""
    temperature = states.temperature.np[idx_mapping_np]
    return (temperature != 0.0) & ((temperature != 1.0) | (states.min_p.np[idx_mapping_np] != 0)
                                   | (states.top_k.np[idx_mapping_np] != states.vocab_size)
                                   | (states.top_p.np[idx_mapping_np] != 1.0))


def needs_full_sampler(sampler, idx_mapping_np: np.ndarray, has_grammar: bool) -> bool:
    """Whether a request of the batch needs what tree verification does not
    apply to draft nodes (see the module docstring)."""
    states = sampler.sampling_states
    processors = (sampler.needs_logits_processing[idx_mapping_np]
                  & ~sampling_params_need_processing(states, idx_mapping_np))
    return bool(has_grammar or processors.any()
                or states.max_num_logprobs(idx_mapping_np) != NO_LOGPROBS
                or sampler.return_sampling_mask or sampler.trace_replay_state is not None)


class V2TreeRejectionSampler:
    # vLLM's adaptive verification reallocates chain drafts; trees keep their
    # shape (the runner's warm-up reads this flag of every rejection sampler)
    enable_adaptive_verification = False

    def __init__(self, sampler, state) -> None:
        self.sampler = sampler  # vLLM's Sampler: sampling states, request states
        self.state = state  # the tree model state; its `tree_slots` is bound at load

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None,
                 invalid_drafts=None) -> SamplerOutput:
        del draft_logits  # trees are verified against the target alone
        slots = self.state.tree_slots
        num_nans = get_num_nans(logits) if self.sampler.compute_nans else None
        idx_np = input_batch.idx_mapping_np[:input_batch.num_reqs]
        if needs_full_sampler(self.sampler, idx_np, invalid_drafts is not None):
            return self._roots_only(logits, input_batch, slots, num_nans)
        num_reqs = input_batch.num_reqs
        verified = verify_tree_greedy_rows(
            logits.argmax(-1), input_batch.input_ids, input_batch.logits_indices,
            input_batch.cu_num_logits, slots.parents, input_batch.idx_mapping[:num_reqs],
            slots.accepted_nodes[:num_reqs], slots.num_drafted, backend="triton")
        temperature = self.sampler.sampling_states.temperature
        if (temperature.np[idx_np] != 0.0).any():
            verified = self._with_stochastic(verified, logits, input_batch, slots)
            slots.accepted_nodes[:num_reqs] = verified.accepted_node_ids
        with torch.profiler.record_function("specplug::compact_kv"):  # bench --phases
            compact_kv(slots, input_batch, verified.accepted_node_ids, verified.num_accepted)
        return self._output(input_batch, verified.output_token_ids,
                            (verified.num_accepted + 1).to(torch.int32), num_nans)

    def _trees(self, input_batch, slots) -> tuple[DraftTree, torch.Tensor]:
        """The batch's trees (token and parent ids; what the kernels read)."""
        idx = input_batch.idx_mapping[:input_batch.num_reqs]
        rows, counts = node_rows(input_batch.cu_num_logits, input_batch.num_reqs,
                                 slots.num_nodes, slots.num_drafted[idx])
        live = torch.arange(slots.num_nodes, device=rows.device)[None] < counts[:, None]
        token_ids = input_batch.input_ids[input_batch.logits_indices[rows]].long()
        parents = slots.parents[idx]
        tree = DraftTree(token_ids=torch.where(live, token_ids, 0),
                         parent_ids=torch.where(live, parents, NO_NODE), cand_ids=EMPTY,
                         depths=EMPTY, positions=EMPTY, attn_mask=EMPTY, packed_mask=EMPTY,
                         first_child_ids=EMPTY, next_sibling_ids=EMPTY)
        return tree, rows

    def _with_stochastic(self, greedy, logits, input_batch, slots):
        """Stochastic verification for the requests sampling at a temperature."""
        tree, rows = self._trees(input_batch, slots)
        sampled = verify_tree_stochastic(tree, self._node_probs(logits, input_batch, rows),
                                         *self._noise(input_batch, tree, logits.shape[1]),
                                         backend="triton", validate=False)
        self._sample_draftless_rows(sampled, logits, input_batch)
        states, idx = self.sampler.sampling_states, input_batch.idx_mapping[:input_batch.num_reqs]
        is_greedy = (states.temperature.gpu[idx] == 0.0)[:, None]
        for name in ("output_token_ids", "accepted_node_ids"):
            setattr(sampled, name, torch.where(is_greedy, getattr(greedy, name),
                                               getattr(sampled, name)))
        sampled.num_accepted = torch.where(is_greedy[:, 0], greedy.num_accepted,
                                           sampled.num_accepted)
        return sampled

    def _node_probs(self, logits, input_batch, rows) -> torch.Tensor:
        """[B, N, V] float32: each node's distribution after temperature,
        min_p, top-k and top-p (vLLM's own functions, per request)."""
        states, idx_np = self.sampler.sampling_states, input_batch.idx_mapping_np
        idx_np = idx_np[:input_batch.num_reqs]
        expanded = input_batch.expanded_idx_mapping
        processed = logits.float()  # a copy for bf16/fp16 logits; never written in place below
        processed = processed.clone() if processed is logits else processed
        states.apply_temperature(processed, expanded, idx_np)
        states.apply_min_p(processed, expanded, idx_np)
        top_k, top_p = states.get_top_k_top_p(expanded, idx_np)
        if top_k is not None or top_p is not None:
            processed = apply_top_k_top_p(processed, top_k, top_p)
        return processed.softmax(-1)[rows]

    def _noise(self, input_batch, tree, vocab_size: int):
        """Uniforms [B, N] for acceptances and Exp(1) [B, V] for the residual
        sample, from each request's seed and root position: seq_len minus
        its logits rows (a tree's first query row; a prefill's last prompt
        token, wherever its chunk began: a prefix-cache hit or a chunked
        prefill must not change a seeded request's noise)."""
        num_reqs = input_batch.num_reqs
        idx = input_batch.idx_mapping[:num_reqs]
        seeds = self.sampler.sampling_states.seeds.gpu[idx]
        cu_logits = input_batch.cu_num_logits[:num_reqs + 1].long()
        roots = input_batch.seq_lens[:num_reqs].long() - (cu_logits[1:] - cu_logits[:-1])
        uniform = seeded_uniform(seeds, 2 * roots, tree.token_ids.shape[1])
        exp = -torch.log(seeded_uniform(seeds, 2 * roots + 1, vocab_size).clamp_(min=1e-20))
        return uniform, exp

    def _sample_roots(self, logits, input_batch):
        """vLLM's sampler at every request's root row (its first logits row)."""
        num_reqs = input_batch.num_reqs
        roots = input_batch.cu_num_logits[:num_reqs].long()
        arange = np.arange(num_reqs + 1, dtype=np.int32)
        root_batch = dataclasses.replace(
            input_batch, expanded_idx_mapping=input_batch.idx_mapping,
            expanded_local_pos=torch.zeros_like(input_batch.idx_mapping, dtype=torch.int32),
            logits_indices=input_batch.logits_indices[roots], cu_num_logits_np=arange,
            cu_num_logits=torch.from_numpy(arange).to(logits.device), num_draft_tokens=0,
            num_draft_tokens_per_req=None)
        return self.sampler(logits[roots], root_batch)

    def _sample_draftless_rows(self, sampled, logits, input_batch) -> None:
        """Requests with no draft this step (a prefill, a decode drafted
        nothing) take vLLM's sample, in place: vLLM's runner samples a
        batch without drafts with its own sampler, so a seeded request's
        token must not depend on whether others in its batch had trees."""
        num_reqs = input_batch.num_reqs
        draftless = np.diff(input_batch.cu_num_logits_np[:num_reqs + 1]) == 1
        if not draftless.any():
            return
        ids = self._sample_roots(logits, input_batch).sampled_token_ids[:num_reqs, 0]
        rows = to_device(np.flatnonzero(draftless), logits.device)
        sampled.output_token_ids[rows, 0] = ids[rows].to(sampled.output_token_ids.dtype)

    def _roots_only(self, logits, input_batch, slots, num_nans) -> SamplerOutput:
        """vLLM's sampler at every request's root row; every draft rejected."""
        num_reqs = input_batch.num_reqs
        roots = input_batch.cu_num_logits[:num_reqs].long()
        out = self._sample_roots(logits, input_batch)
        tokens = torch.full((num_reqs, slots.num_nodes), NO_NODE, dtype=torch.int64,
                            device=logits.device)
        tokens[:, :1] = out.sampled_token_ids[:num_reqs]
        slots.accepted_nodes[:num_reqs] = NO_NODE
        slots.accepted_nodes[:num_reqs, 0] = 0
        output = self._output(input_batch, tokens, torch.ones_like(roots, dtype=torch.int32),
                              num_nans)
        output.logprobs_tensors = out.logprobs_tensors
        output.sampling_mask_tensors = out.sampling_mask_tensors
        return output

    def _output(self, input_batch, tokens, num_sampled, num_nans) -> SamplerOutput:
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits,
            input_batch.idx_mapping, self.sampler.req_states.prefill_len.gpu)
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None,
                             num_nans=num_nans, num_sampled=num_sampled,
                             num_rejected=num_rejected)


def compact_kv(slots, input_batch, accepted_nodes: torch.Tensor,
               num_accepted: torch.Tensor) -> None:
    """Move each accepted node's K/V to its path depth in every layer:
    `kernels/kv_compaction.py` per layer, on vLLM's per-slot cache rows (K
    and V of every KV head), only the nodes that move."""
    if not slots.kv_caches or slots.block_table is None:
        raise RuntimeError("tree verification on Model Runner V2: the KV caches or this "
                           "step's block table were not bound to the tree slots")
    num_reqs = input_batch.num_reqs
    if slots.kv_layers is not None:  # one launch for all layers
        compact_kv_layers(slots.kv_layers, slots.block_table[:num_reqs],
                          input_batch.query_start_loc, input_batch.seq_lens, accepted_nodes,
                          num_accepted)
        return
    starts = input_batch.query_start_loc[:num_reqs + 1].long()
    root_positions = input_batch.seq_lens[:num_reqs].long() - (starts[1:] - starts[:-1])
    for cache in slots.kv_caches:
        compact_kv_cache(cache, slots.block_table[:num_reqs], root_positions, accepted_nodes,
                         num_accepted, validate=False)
