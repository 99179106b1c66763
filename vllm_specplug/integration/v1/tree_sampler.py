"""Tree verification in the model runner, then KV compaction.

Replaces the runner's `rejection_sampler` when the method is specplug_eagle3
(vLLM's `RejectionSampler` verifies chains only). The logits it receives are
vLLM's: one row per scheduled node (root first) for requests with drafts,
one row for the others, in batch order. Every request becomes a tree
(`tree_from_parents`; no drafts = a root alone) and goes through our greedy
(temperature 0) or stochastic (SpecInfer-style, lossless) tree verification;
the output has vLLM's layout ([B, max_spec_len + 1], PLACEHOLDER-padded), so
the scheduler and metrics read accepted counts and per-depth acceptance as
they do for chains.

Batches whose sampling needs vLLM's full sampler (logprobs, penalties, bad
words, allowed ids, min_tokens, logit bias, min_p, custom logits processors)
accept no drafts this step: every request gets vLLM's own sample at its root
(lossless, only speculation is lost).
"""
from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                     MinPLogitsProcessor,
                                                     MinTokensLogitsProcessor)
from vllm.v1.sample.rejection_sampler import RejectionSampler, apply_sampling_constraints

from vllm_specplug.integration.v1.cpu_kv_layout import known_layout
from vllm_specplug.integration.cuda_tree_attention import move_cached_tokens
from vllm_specplug.integration.v1.tree_profile import PROFILER
from vllm_specplug.verification.metadata import PLACEHOLDER_TOKEN_ID
from vllm_specplug.verification.tree_build import tree_from_parents
from vllm_specplug.verification.tree_greedy import verify_tree_greedy
from vllm_specplug.verification.tree_sampling import verify_tree_stochastic

GREEDY_BELOW = 1e-5  # vLLM marks greedy requests with temperature -1


def _active(processor) -> bool:
    if isinstance(processor, MinTokensLogitsProcessor):
        return bool(processor.min_toks)
    if isinstance(processor, LogitBiasLogitsProcessor):
        return bool(processor.biases)
    if isinstance(processor, MinPLogitsProcessor):
        return bool(processor.min_p_count)
    return True  # a custom processor: assume it changes the distribution


def needs_full_sampler(meta) -> bool:
    """Sampling features tree verification does not apply to draft nodes."""
    holder = meta.thinking_budget_state_holder
    return (meta.max_num_logprobs is not None or not meta.no_penalties
            or bool(meta.bad_words_token_ids) or meta.allowed_token_ids_mask is not None
            or (holder is not None and holder.has_tracked_requests())
            or any(_active(p) for p in meta.logitsprocs.all))


class TreeRejectionSampler(RejectionSampler):
    def __init__(self, sampler, speculative_config, device, runner) -> None:
        super().__init__(sampler, speculative_config, device)
        self.runner = runner

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        step = self.runner.drafter.current_step
        if step is None:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        PROFILER.mark("verify_start")
        choices = getattr(self.runner.drafter, "tree_choices", None)
        if needs_full_sampler(sampling_metadata):
            if choices is not None:  # unmasked trees' roots (tree_choices.py)
                choices.mask_roots(self.runner, metadata, logits)
            output = self._roots_only(metadata, logits, sampling_metadata, step)
        else:
            output = self._verify(metadata, logits, sampling_metadata, step)
        PROFILER.mark("verify_end")
        return output

    def _roots_only(self, metadata, logits, sampling_metadata, step) -> SamplerOutput:
        """vLLM's sampler at every request's root row; all drafts rejected."""
        num_nodes = torch.tensor(metadata.num_draft_tokens) + 1
        roots = (torch.cumsum(num_nodes, 0) - num_nodes).to(logits.device)
        out = self.sampler(logits=logits[roots], sampling_metadata=sampling_metadata)
        step.accepted = {r.req_id: [0] for r in step.requests}
        width = metadata.max_spec_len + 1
        return SamplerOutput(sampled_token_ids=_pad(out.sampled_token_ids, width),
                             logprobs_tensors=_spread_roots(out.logprobs_tensors, width))

    def _verify(self, metadata, logits, sampling_metadata, step) -> SamplerOutput:
        tree, rows = _trees(metadata, step, logits.device)
        draws = logits.argmax(-1)  # [num_logits]: the greedy draws
        choices = getattr(self.runner.drafter, "tree_choices", None)
        if choices is not None:  # greedy trees left unmasked (tree_choices.py)
            cut = choices.correct(self.runner, step, metadata, logits, draws)
            _cut_nodes(tree, rows, cut)
        result = verify_tree_greedy(tree, draws[rows.clamp(min=0)], validate=False)
        if not sampling_metadata.all_greedy:
            target = logits[rows.clamp(min=0)].float()  # [B, N, V]
            sampled = self._verify_stochastic(tree, target, rows, sampling_metadata)
            greedy = sampling_metadata.temperature < GREEDY_BELOW
            for name in ("output_token_ids", "num_accepted", "accepted_node_ids"):
                chosen = torch.where(greedy.view(-1, *[1] * (getattr(result, name).dim() - 1)),
                                     getattr(result, name), getattr(sampled, name))
                setattr(result, name, chosen)
        # one device-to-host copy for the whole batch (not one per request)
        host = torch.cat([result.num_accepted[:, None].long(),
                          result.accepted_node_ids.long()], 1).cpu().numpy()
        for request in step.requests:
            num_accepted, path = host[request.row, 0], host[request.row, 1:]
            step.accepted[request.req_id] = path[:num_accepted + 1].tolist()
        compact_kv(self.runner, step)
        return SamplerOutput(sampled_token_ids=result.output_token_ids.to(torch.int32),
                             logprobs_tensors=None)

    def _verify_stochastic(self, tree, target_logits, rows, sampling_metadata):
        """Node distributions after temperature/top-k/top-p (vLLM's own
        `apply_sampling_constraints`), then lossless tree rejection sampling."""
        batch, width, vocab = target_logits.shape
        valid = rows >= 0
        flat = target_logits[valid]  # [sum nodes, V], request-major
        cu_nodes = torch.cumsum(valid.sum(1), 0).to(torch.int32)
        probs_flat = apply_sampling_constraints(flat.clone(), cu_nodes,
                                                sampling_metadata).softmax(-1)
        probs = probs_flat[cu_nodes.long() - valid.sum(1)][:, None].repeat(1, width, 1)
        probs[valid] = probs_flat  # padding rows keep the root's (never read)
        uniform, exp = self.random_samples(batch, width, vocab, sampling_metadata,
                                           target_logits.device)
        return verify_tree_stochastic(tree, probs, uniform, exp, validate=False)

    @staticmethod
    def random_samples(batch: int, width: int, vocab: int, sampling_metadata, device):
        """uniform [B, N] (acceptances) and Exp(1) [B, V] (residual sample),
        from each seeded request's own generator."""
        uniform = torch.empty(batch, width, device=device)
        exp = torch.empty(batch, vocab, device=device)
        for b in range(batch):
            generator = sampling_metadata.generators.get(b)
            uniform[b].uniform_(generator=generator)
            exp[b].exponential_(generator=generator)
        return uniform, exp


def _cut_nodes(tree, rows: torch.Tensor, cut: list[int]) -> None:
    """The nodes at logits rows `cut` get token -1, which no draw equals."""
    if cut:
        tree.token_ids[torch.isin(rows, torch.tensor(cut, device=rows.device))] = -1


def _spread_roots(tensors: LogprobsTensors | None, width: int) -> LogprobsTensors | None:
    """The roots' logprobs [B, ...] laid out as vLLM's `parse_output` reads a
    rejection sampler's: one row per output slot, [B * width, ...], filtered
    by the slots that hold a token (here each request's first). Handed over
    as they were, a batch with logprobs failed there (a mask of B * width
    rows over B)."""
    if tensors is None:
        return None
    batch = tensors.logprob_token_ids.shape[0]
    at = torch.arange(batch, device=tensors.logprob_token_ids.device) * width

    def spread(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.new_zeros((batch * width, *tensor.shape[1:]))
        out[at] = tensor
        return out

    return LogprobsTensors(spread(tensors.logprob_token_ids), spread(tensors.logprobs),
                           spread(tensors.selected_token_ranks))


def _pad(token_ids: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.full((token_ids.shape[0], width), PLACEHOLDER_TOKEN_ID,
                     dtype=token_ids.dtype, device=token_ids.device)
    out[:, :token_ids.shape[1]] = token_ids
    return out


def _trees(metadata, step, device):
    """Padded trees of every request and their logits rows [B, N] (-1 = pad)."""
    num_drafts = torch.tensor(metadata.num_draft_tokens)
    batch, width = len(num_drafts), metadata.max_spec_len + 1
    starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    node = torch.arange(width)
    num_nodes = num_drafts + 1
    rows = torch.where(node[None] < num_nodes[:, None], starts[:, None] + node[None], -1)
    token_ids = torch.zeros(batch, width, dtype=torch.long)
    draft_starts = starts - torch.arange(batch)  # drafts exclude the roots
    flat = metadata.draft_token_ids.cpu().long()
    parents = torch.zeros(batch, width, dtype=torch.long)
    for request in step.requests:
        n = request.num_nodes
        first = int(draft_starts[request.row])
        token_ids[request.row, 1:n] = flat[first:first + n - 1]
        parents[request.row, :n] = torch.from_numpy(request.parent_ids)
    tree = tree_from_parents(token_ids, parents, num_nodes, torch.zeros(batch, dtype=torch.long))
    return _to(tree, device), rows.to(device)


def _to(tree, device):
    """The tree on `device` with one host-to-device copy per dtype (the
    [B, N] int64 fields go stacked), not one per field. (On the CPU too, so
    that the CPU tests run this path.)"""
    fields = {n: v for n, v in vars(tree).items() if v is not None}  # score_ranks: unset here
    stacked = [n for n, v in fields.items() if v.dtype == torch.int64 and v.dim() == 2]
    moved = torch.stack([fields[n] for n in stacked]).to(device)
    for i, name in enumerate(stacked):
        setattr(tree, name, moved[i])
    for name in set(fields) - set(stacked):
        setattr(tree, name, fields[name].to(device))
    return tree


def compact_kv(runner, step) -> None:
    """Move each accepted node's K/V from slot position seq_len + node to
    seq_len + depth in every attention layer (rows of this step's slot
    mapping, which vLLM computed from sequential positions)."""
    src, dst = [], []
    for request in step.requests:
        path = step.accepted.get(request.req_id, [0])
        for depth, node in enumerate(path):
            if node != depth:
                src.append(request.first_token + node)
                dst.append(request.first_token + depth)
    if not src:
        return
    slots = runner.input_batch.block_table[0].slot_mapping.gpu
    src_slots, dst_slots = slots[src].long(), slots[dst].long()
    for kv_cache in runner.kv_caches:
        if kv_cache.is_cuda:
            move_cached_tokens(kv_cache, src_slots, dst_slots)
            continue
        layout = known_layout(kv_cache)
        if layout is None:  # tree attention ran on every layer of a non-chain tree
            raise RuntimeError("KV compaction: no known layout for a KV cache "
                               f"{tuple(kv_cache.shape)}; tree attention did not run")
        keys, values = layout.read(kv_cache, src_slots)  # every read before any write
        layout.write(kv_cache, dst_slots, keys, values)
