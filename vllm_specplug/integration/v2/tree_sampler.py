"""Tree verification on Model Runner V2, then KV compaction.

The model state hands this to the runner as its rejection sampler
(`ModelState.custom_sampler`, tree_state.py). It is called with vLLM's
logits, one row per tree node (root first) of each request that verifies a
tree and one row for the others, in `cu_num_logits` layout.

**Sample every node, then walk.** vLLM's own sampler draws the target's
token at every logits row, exactly as it would without speculation: the
same temperature, min_p, top-k and top-p (top-k/top-p in calls of the size
no speculation's step makes: vLLM's Triton top-p keeps other tokens at the
nucleus' edge in a larger call), and on Model Runner V2 the same
Gumbel noise, keyed by the request's seed and the row's position (the
layout already moved a node's position to `seq_len + depth`). The tree is
then walked greedily against those tokens (`verify_tree_greedy_rows`): a
node is accepted when its parent was and its token is what the target drew
there; the bonus token is the draw at the last accepted node. Each emitted
token is the target's own draw in its own context, so the output is
distributed as without speculation, and with a seed it is the very tokens
no speculation draws, whatever the tree's size or the batch. For drafts
taken without their probabilities this accepts as often as "target only"
rejection sampling (SpecInfer, SGLang's `tree_speculative_sampling_target_only`):
a child set is accepted with probability sum p(child) in both. At
temperature 0 the draw is the argmax: greedy verification.

Each request becomes a tree from its state slot's parents (`TreeSlots`;
nodes past what was scheduled, or past what its last tree had, are cut).
The output has vLLM's layout ([B, N] tokens: the accepted path then the
bonus token), so `post_update`, the scheduler and the metrics read it as
they read chains. Accepted paths are kept for the drafter's ingest, and
each path's K/V moves from the node's slot (`seq_len + node`) to
`seq_len + depth` in every layer, with the compaction kernel
`kernels/kv_compaction.py`.

**Structured output.** With our tree scheduler (`SpecplugTreeAsyncScheduler`,
the default for tree methods) every node's row arrives masked by the
grammar state of its own path, and an invalid node's row by its parent's,
which forbids the node's token (integration/grammar_trees.py): the draws
and the walk above then stay exact, unchanged. Drafts that vLLM marks
invalid (`invalid_drafts`: a reasoning section's chain rules) are never
accepted. With `grammar_verify: "choices"` a greedy batch's trees whose
rows the worker fills arrive unmasked instead, and their draws on each
accepted path are set to the masked choice before the walk
(integration/grammar_choices.py): the same path and tokens. Under a
scheduler of the user's, which masks drafts as a list,
batches with structured output are treated as below.

Batches whose sampling needs vLLM's full sampler on every row in order
(logprobs, logits processors: penalties, bad words, logit bias, min tokens,
thinking budgets; sampling masks) accept no drafts this step: vLLM's own
sampler samples each request's root row (lossless; only speculation is
lost). Those read a request's earlier rows as its history, which a tree's
sibling rows are not.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

from vllm_specplug.integration.ranges import profiled_range
from vllm_specplug.verification.backend import to_device
from vllm_specplug.verification.kv_compaction import compact_kv_cache, compact_kv_layers
from vllm_specplug.verification.metadata import NO_NODE
from vllm_specplug.verification.tree_greedy_rows import verify_tree_greedy_rows


# vLLM's Triton top-p runs calls of at most this many rows through its
# split-row pipeline, larger ones through one program per row, and the two
# keep different tokens at the nucleus' edge (on the H200, 56 of 128 rows
# differed by up to 4 tokens: benchmarks/gpu/topp_batch_check.py)
TOP_P_SPLIT_MAX_ROWS = 64


def top_k_top_p_as_without_speculation(logits: torch.Tensor, top_k: torch.Tensor | None,
                                       top_p: torch.Tensor | None, num_reqs: int
                                       ) -> torch.Tensor:
    """vLLM's top-k/top-p over [num_logits, V] rows, each row masked by the
    kernel a step without speculation uses for a batch of `num_reqs` (one
    row per request): calls of at most TOP_P_SPLIT_MAX_ROWS rows while the
    batch is that small, one call otherwise. A tree of 16 nodes for 8
    requests is 128 rows: in one call its rows were masked unlike no
    speculation's 8, and a seeded sample drew a token past no speculation's
    nucleus (docs/results/seeded_tree_topp_h200)."""
    if top_k is None and top_p is None:
        return logits
    num_rows = logits.shape[0]
    if num_reqs > TOP_P_SPLIT_MAX_ROWS or num_rows <= TOP_P_SPLIT_MAX_ROWS:
        return apply_top_k_top_p(logits, top_k, top_p)
    for start in range(0, num_rows, TOP_P_SPLIT_MAX_ROWS):
        part = slice(start, start + TOP_P_SPLIT_MAX_ROWS)
        logits[part] = apply_top_k_top_p(logits[part], None if top_k is None else top_k[part],
                                         None if top_p is None else top_p[part])
    return logits


def sampling_params_need_processing(states, idx_mapping_np: np.ndarray) -> np.ndarray:
    """[B] bool: vLLM's `SamplingStates.add_request` verdict for temperature,
    min_p, top-k and top-p alone (what is applied to every node's row)."""
    temperature = states.temperature.np[idx_mapping_np]
    return (temperature != 0.0) & ((temperature != 1.0) | (states.min_p.np[idx_mapping_np] != 0)
                                   | (states.top_k.np[idx_mapping_np] != states.vocab_size)
                                   | (states.top_p.np[idx_mapping_np] != 1.0))


def needs_full_sampler(sampler, idx_mapping_np: np.ndarray, has_grammar: bool) -> bool:
    """Whether a request of the batch needs what is not applied to draft
    nodes (see the module docstring)."""
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

    def __init__(self, sampler, state, grammar_rows_per_node: bool = False) -> None:
        self.sampler = sampler  # vLLM's Sampler: sampling states, request states
        self.state = state  # the tree model state; its `tree_slots` is bound at load
        # the scheduler masks each node's row on its own path (a TreeGrammarScheduler)
        self.grammar_rows_per_node = grammar_rows_per_node

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None,
                 invalid_drafts=None) -> SamplerOutput:
        del draft_logits  # trees are verified against the target alone
        slots = self.state.tree_slots
        num_nans = get_num_nans(logits) if self.sampler.compute_nans else None
        idx_np = input_batch.idx_mapping_np[:input_batch.num_reqs]
        list_masks = input_batch.has_structured_output_reqs and not self.grammar_rows_per_node
        if needs_full_sampler(self.sampler, idx_np, list_masks):
            return self._roots_only(logits, input_batch, slots, num_nans)
        num_reqs = input_batch.num_reqs
        target_tokens = self._target_tokens(logits, input_batch)
        choices = getattr(self.state, "grammar_choices", None)
        if choices is not None:  # greedy constrained trees left unmasked (grammar_choices.py)
            with profiled_range("specplug::grammar_choices"):
                cut = choices.correct(logits, target_tokens, input_batch)
            invalid_drafts = with_rows_invalid(invalid_drafts, cut, logits)
        verified = verify_tree_greedy_rows(
            target_tokens,
            node_token_ids(input_batch.input_ids, input_batch.logits_indices, invalid_drafts),
            input_batch.logits_indices, input_batch.cu_num_logits, slots.parents,
            input_batch.idx_mapping[:num_reqs], slots.accepted_nodes[:num_reqs],
            slot_num_nodes=slots.num_drafted, backend="triton")
        with profiled_range("specplug::compact_kv"):  # bench --phases
            compact_kv(slots, input_batch, verified.accepted_node_ids, verified.num_accepted)
        return self._output(input_batch, verified.output_token_ids,
                            (verified.num_accepted + 1).to(torch.int32), num_nans)

    def _target_tokens(self, logits, input_batch) -> torch.Tensor:
        """[num_logits] int64: vLLM's sampler's draw at every logits row, at
        the row's (tree) position; the argmax where the temperature is 0.
        vLLM's `Sampler.sample` step by step, but for top-k/top-p, which is
        applied as a step without speculation applies it to each row
        (`top_k_top_p_as_without_speculation`)."""
        num_reqs, sampler = input_batch.num_reqs, self.sampler
        states, idx_np = sampler.sampling_states, input_batch.idx_mapping_np[:num_reqs]
        if (states.temperature.np[idx_np] == 0.0).all():
            return logits.argmax(-1)  # what gumbel_sample returns at temperature 0
        rows, expanded = input_batch.logits_indices, input_batch.expanded_idx_mapping
        positions = input_batch.positions[rows]
        processed = sampler.apply_sampling_params(
            logits, expanded, input_batch.idx_mapping[:num_reqs], idx_np, positions,
            input_batch.input_ids[rows], input_batch.expanded_local_pos,
            input_batch.seq_lens_cpu_upper_bound.numpy(), skip_top_k_top_p=True)
        top_k, top_p = states.get_top_k_top_p(expanded, idx_np)
        processed = top_k_top_p_as_without_speculation(processed, top_k, top_p, num_reqs)
        return gumbel_sample(processed, expanded, states.temperature.gpu, states.seeds.gpu,
                             positions, apply_temperature=False, is_drafting=False,
                             use_fp64=sampler.use_fp64_gumbel)

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


def with_rows_invalid(invalid_drafts: torch.Tensor | None, rows: list[int],
                      logits: torch.Tensor) -> torch.Tensor | None:
    """`invalid_drafts` [num_logits] bool with `rows` set too (None: none)."""
    if not rows:
        return invalid_drafts
    if invalid_drafts is None:
        invalid_drafts = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    # queued through pinned memory: torch.tensor(rows, device=...) copies
    # from pageable memory and waits for the GPU's whole queue
    invalid_drafts[to_device(np.asarray(rows, dtype=np.int64), logits.device)] = True
    return invalid_drafts


def node_token_ids(input_ids: torch.Tensor, logits_indices: torch.Tensor,
                   invalid_drafts: torch.Tensor | None) -> torch.Tensor:
    """The input ids the walk reads each node's token from, with the drafts
    vLLM marked invalid (`invalid_drafts` [num_logits] bool, by logits row:
    the draft at that row's position) set to -1, which no draw equals."""
    if invalid_drafts is None:
        return input_ids
    ids = input_ids.clone()
    ids[logits_indices[invalid_drafts]] = -1
    return ids


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
