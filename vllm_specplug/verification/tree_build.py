"""EAGLE-2 dynamic draft trees (arXiv 2406.16858): pool the draft's candidates,
keep the best `num_draft_tokens - 1` by path score, and lay them out as a tree.

`build_draft_tree` validates and dispatches; `build_draft_tree_reference` is the
plain-PyTorch specification the Triton kernel (`kernels/tree_build.py`) must
equal exactly.
"""
from __future__ import annotations

import torch

from vllm_specplug.verification import checks
from vllm_specplug.verification.backend import Backend, resolve_backend
from vllm_specplug.verification.tree_masks import ancestor_mask
from vllm_specplug.verification.metadata import (MASK_WORD_BITS, NO_NODE,
                                                 ROOT_PARENT, DraftCandidates,
                                                 DraftTree)


def flatten_draft_steps(step_token_ids: list[torch.Tensor],
                        step_logprobs: list[torch.Tensor],
                        step_beam_ids: list[torch.Tensor]) -> DraftCandidates:
    """Pool per-step top-k outputs into candidates with path scores.

    Step d expanded R_d beam nodes: `step_token_ids[d]`, `step_logprobs[d]`
    are [B, R_d, K] (the draft's top-k and their conditional log-probs) and
    `step_beam_ids[d]` [B, R_d] int64 gives, for each row, the pooled index of
    the node it expanded (ROOT_PARENT at step 0, where R_0 = 1).
    """
    tokens, scores, parents = [], [], []
    for token_ids, logprobs, beam_ids in zip(step_token_ids, step_logprobs,
                                             step_beam_ids):
        parent_scores = torch.zeros_like(beam_ids, dtype=logprobs.dtype)
        if scores:
            pooled = torch.cat(scores, dim=1)
            parent_scores = torch.where(beam_ids == ROOT_PARENT, parent_scores,
                                        pooled.gather(1, beam_ids.clamp(min=0)))
        scores.append((parent_scores[..., None] + logprobs).flatten(1))
        parents.append(beam_ids[..., None].expand_as(token_ids).flatten(1))
        tokens.append(token_ids.flatten(1))
    return DraftCandidates(torch.cat(tokens, 1), torch.cat(scores, 1),
                           torch.cat(parents, 1))


def extend_draft_pool(pool: DraftCandidates | None, token_ids: torch.Tensor,
                      logprobs: torch.Tensor, beam_ids: torch.Tensor) -> DraftCandidates:
    """`flatten_draft_steps` one step at a time: the candidates pooled so far
    (None before step 0) and step d's [B, R_d, K] top-k, their log-probs and
    the [B, R_d] pooled ids of the nodes it expanded (ROOT_PARENT at step
    0). A drafting pass calls this once a step, where re-pooling every step
    from the start costs a few launches per earlier step (the pass is
    launch-bound on the GPU)."""
    if pool is None:
        parent_scores = torch.zeros_like(beam_ids, dtype=logprobs.dtype)
    else:
        parent_scores = pool.scores.gather(1, beam_ids.clamp(min=0))
    step = DraftCandidates(token_ids.flatten(1),
                           (parent_scores[..., None] + logprobs).flatten(1),
                           beam_ids[..., None].expand_as(token_ids).flatten(1))
    if pool is None:
        return step
    return DraftCandidates(*(torch.cat([old, new], dim=1) for old, new in (
        (pool.token_ids, step.token_ids), (pool.scores, step.scores),
        (pool.parent_ids, step.parent_ids))))


def next_beam(step_scores: torch.Tensor, step_offset: int, topk: int) -> torch.Tensor:
    """[B, topk] pooled ids of the best candidates of the last step: the nodes
    the draft expands next (EAGLE-2 keeps the best k of k*k)."""
    return step_scores.topk(topk, dim=1).indices + step_offset


def _ancestry(parent_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [B, N], ancestor mask [B, N, N]) by the specification
    (tree_masks.ancestor_mask); a node's depth is its number of proper
    ancestors."""
    mask = torch.from_numpy(ancestor_mask(parent_ids.cpu().numpy())).to(parent_ids.device)
    return mask.sum(-1) - 1, mask


def _links(parent_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child / next-sibling lists; children in ascending node order."""
    rows = torch.arange(parent_ids.shape[0], device=parent_ids.device)
    first_child = torch.full_like(parent_ids, NO_NODE)
    next_sibling = torch.full_like(parent_ids, NO_NODE)
    for i in range(parent_ids.shape[1] - 1, 0, -1):
        parent = parent_ids[:, i]
        next_sibling[:, i] = first_child[rows, parent]
        first_child[rows, parent] = i
    return first_child, next_sibling


def _ancestry_closure(parent_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_ancestry` without a loop over nodes (the engine builds a tree per
    request every step, on the host, where a torch op costs microseconds):
    ancestor-or-self is the transitive closure of "is the parent of", reached
    by ceil(log2 N) squarings of I + A ([B, N, N] 0/1, exact in float32);
    a node's depth is its number of proper ancestors."""
    num_nodes = parent_ids.shape[1]
    has_parent = (parent_ids >= 0)[..., None]
    adjacency = torch.nn.functional.one_hot(parent_ids.clamp(min=0), num_nodes) * has_parent
    reach = adjacency.float() + torch.eye(num_nodes, device=parent_ids.device)
    for _ in range(max(1, (num_nodes - 1).bit_length())):
        reach = (reach @ reach).clamp(max=1.0)
    mask = reach > 0
    return mask.sum(-1) - 1, mask


def _links_vectorized(parent_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_links` without a loop over nodes: a node's next sibling is the first
    later node with its parent, a node's first child the first node whose
    parent it is ([B, N, N] comparisons; argmax returns the first maximum)."""
    node = torch.arange(parent_ids.shape[1], device=parent_ids.device)
    later_sibling = ((parent_ids[:, :, None] == parent_ids[:, None, :])
                     & (node[:, None] < node[None, :]) & (parent_ids >= 0)[:, :, None])
    child = parent_ids[:, None, :] == node[None, :, None]  # [B, parent, node]
    first_child = torch.where(child.any(-1), child.int().argmax(-1), NO_NODE)
    next_sibling = torch.where(later_sibling.any(-1), later_sibling.int().argmax(-1), NO_NODE)
    return first_child, next_sibling


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool -> [B, N, ceil(N/32)] int32, bit j%32 of word j//32."""
    batch, num_nodes, _ = mask.shape
    num_words = -(-num_nodes // MASK_WORD_BITS)
    padded = torch.zeros(batch, num_nodes, num_words * MASK_WORD_BITS,
                         dtype=torch.int64, device=mask.device)
    padded[..., :num_nodes] = mask
    shifts = torch.arange(MASK_WORD_BITS, device=mask.device)
    words = (padded.view(batch, num_nodes, num_words, MASK_WORD_BITS) << shifts).sum(-1)
    return words.to(torch.int32)  # wraps bit 31 into the sign, as C does


def build_draft_tree_reference(candidates: DraftCandidates,
                               root_token_ids: torch.Tensor,
                               seq_lens: torch.Tensor,
                               num_draft_tokens: int) -> DraftTree:
    """Plain-PyTorch specification of `build_draft_tree` (inputs unchecked)."""
    batch = root_token_ids.shape[0]
    num_selected = num_draft_tokens - 1
    # Stable descending sort: ties go to the earlier candidate, so a parent
    # (earlier, never lower-scoring) is always kept before its child.
    order = torch.sort(candidates.scores, dim=1, descending=True, stable=True).indices
    selected = order[:, :num_selected].sort(dim=1).values
    node_of_cand = torch.full_like(candidates.token_ids, NO_NODE)
    node_ids = torch.arange(1, num_draft_tokens, device=selected.device)
    node_of_cand.scatter_(1, selected, node_ids.expand(batch, -1))
    parent_cand = candidates.parent_ids.gather(1, selected)
    parent_node = torch.where(parent_cand == ROOT_PARENT, 0,
                              node_of_cand.gather(1, parent_cand.clamp(min=0)))
    column = torch.full((batch, 1), NO_NODE, dtype=torch.long, device=selected.device)
    parent_ids = torch.cat([column, parent_node], 1)
    depths, mask = _ancestry(parent_ids)
    first_child, next_sibling = _links(parent_ids)
    return DraftTree(
        token_ids=torch.cat([root_token_ids[:, None],
                             candidates.token_ids.gather(1, selected)], 1),
        parent_ids=parent_ids, cand_ids=torch.cat([column, selected], 1),
        depths=depths, positions=seq_lens[:, None] + depths, attn_mask=mask,
        packed_mask=pack_mask(mask), first_child_ids=first_child,
        next_sibling_ids=next_sibling)


def _check_build_inputs(candidates: DraftCandidates, root_token_ids, seq_lens,
                        num_draft_tokens: int, vocab_size: int | None) -> None:
    batch = root_token_ids.shape[0] if root_token_ids.dim() == 1 else None
    checks.check_shape("root_token_ids", root_token_ids, (None,))
    checks.check_shape("seq_lens", seq_lens, (batch,))
    checks.check_shape("candidates.token_ids", candidates.token_ids, (batch, None))
    num_cands = candidates.token_ids.shape[1]
    for name in ("scores", "parent_ids"):
        checks.check_shape(f"candidates.{name}", getattr(candidates, name),
                           (batch, num_cands))
    for name, tensor in (("root_token_ids", root_token_ids), ("seq_lens", seq_lens),
                         ("candidates.token_ids", candidates.token_ids),
                         ("candidates.parent_ids", candidates.parent_ids)):
        checks.check_dtype(name, tensor, (torch.int64,))
    checks.check_dtype("candidates.scores", candidates.scores, (torch.float32,))
    checks.check_same_device(root_token_ids=root_token_ids, seq_lens=seq_lens,
                             token_ids=candidates.token_ids,
                             scores=candidates.scores, parent_ids=candidates.parent_ids)
    if not 2 <= num_draft_tokens <= num_cands + 1:
        raise checks.VerificationInputError(
            f"num_draft_tokens={num_draft_tokens} must be in [2, {num_cands + 1}] "
            f"(root + at most the {num_cands} candidates)")
    if vocab_size is not None:
        checks.check_range("candidates.token_ids", candidates.token_ids, 0, vocab_size)
        checks.check_range("root_token_ids", root_token_ids, 0, vocab_size)
    checks.check_parents_earlier("candidates.parent_ids", candidates.parent_ids,
                                 ROOT_PARENT)
    _check_scores_are_path_scores(candidates)


def _check_scores_are_path_scores(candidates: DraftCandidates) -> None:
    scores = candidates.scores
    if torch.isnan(scores).any():
        raise checks.VerificationInputError("candidates.scores holds NaN")
    parents = candidates.parent_ids
    parent_scores = scores.gather(1, parents.clamp(min=0))
    rising = (parents != ROOT_PARENT) & (scores > parent_scores)
    if rising.any():
        b, i = rising.nonzero()[0].tolist()
        raise checks.VerificationInputError(
            f"candidates.scores[{b}, {i}] exceeds its parent's score: scores "
            "must be path log-probabilities (a child adds a log-prob <= 0)")


def build_draft_tree(candidates: DraftCandidates, root_token_ids: torch.Tensor,
                     seq_lens: torch.Tensor, num_draft_tokens: int,
                     vocab_size: int | None = None,
                     backend: Backend = "auto", validate: bool = True) -> DraftTree:
    """Select the best `num_draft_tokens - 1` candidates and build the tree.

    Args:
        candidates: [B, C] pooled draft candidates (`flatten_draft_steps`).
        root_token_ids: [B] int64, the last verified token of each request.
        seq_lens: [B] int64, tokens already in the KV cache (the root's position).
        num_draft_tokens: N, tree size including the root.
        vocab_size: when given, token ids are checked against it.
        validate: check inputs first (host syncs); hot paths whose inputs are
            built by our own code pass False.
    Returns:
        DraftTree with N nodes per request, parents before children.
    """
    if validate:
        _check_build_inputs(candidates, root_token_ids, seq_lens, num_draft_tokens,
                            vocab_size)
    if resolve_backend(backend, root_token_ids) == "torch":
        return build_draft_tree_reference(candidates, root_token_ids, seq_lens,
                                          num_draft_tokens)
    from vllm_specplug.verification.tree_build_triton import build_draft_tree_triton

    return build_draft_tree_triton(candidates, root_token_ids, seq_lens,
                                   num_draft_tokens)


def tree_from_parents(token_ids: torch.Tensor, parent_ids: torch.Tensor,
                      num_nodes: torch.Tensor, seq_lens: torch.Tensor) -> DraftTree:
    """A DraftTree from explicit node lists, for trees an engine scheduled.

    Args:
        token_ids: [B, N] int64, node 0 = root; entries past `num_nodes[b]`
            are padding.
        parent_ids: [B, N] int64, parent node of each node (root: NO_NODE),
            parents before children; padding entries may hold anything.
        num_nodes: [B] int64, real nodes per request (root included, >= 1).
        seq_lens: [B] int64, the root's position.
    Padding nodes are unreachable: no child or sibling link points to them,
    so no verifier can accept them (their mask rows see only themselves).
    """
    batch, width = token_ids.shape
    node = torch.arange(width, device=token_ids.device)
    pad = node[None, :] >= num_nodes[:, None]
    parents = torch.where(pad, 0, parent_ids)
    parents[:, 0] = NO_NODE
    depths, mask = _ancestry_closure(parents)
    first_child, next_sibling = _links_vectorized(parents)
    first_child = torch.where(first_child >= num_nodes[:, None], NO_NODE, first_child)
    next_sibling = torch.where(next_sibling >= num_nodes[:, None], NO_NODE, next_sibling)
    mask = mask & ~(pad[:, :, None] | pad[:, None, :]) | torch.diag_embed(pad)
    depths = torch.where(pad, 0, depths)
    return DraftTree(
        token_ids=token_ids, parent_ids=torch.where(pad, NO_NODE, parents),
        cand_ids=torch.full_like(token_ids, NO_NODE), depths=depths,
        positions=seq_lens[:, None] + depths, attn_mask=mask,
        packed_mask=pack_mask(mask), first_child_ids=first_child,
        next_sibling_ids=next_sibling)


def chain_tree(token_ids: torch.Tensor, seq_lens: torch.Tensor) -> DraftTree:
    """The DraftTree of chains: token_ids [B, N] (node 0 = root, node i's
    parent i - 1) at seq_lens [B] (the root's position). What
    `build_draft_tree` returns for a top-1 draft, from constants: no sort,
    no ancestry walk (a chain drafter's hot path)."""
    batch, num_nodes = token_ids.shape
    node = torch.arange(num_nodes, device=token_ids.device)
    previous = torch.where(node > 0, node - 1, NO_NODE)
    following = torch.where(node < num_nodes - 1, node + 1, NO_NODE)
    mask = (node[None, :] <= node[:, None])[None].expand(batch, -1, -1)
    rows = lambda row: row[None].expand(batch, -1)  # noqa: E731
    return DraftTree(token_ids=token_ids, parent_ids=rows(previous), cand_ids=rows(previous),
                     depths=rows(node), positions=seq_lens[:, None] + node,
                     attn_mask=mask, packed_mask=pack_mask(mask[:1]).expand(batch, -1, -1),
                     first_child_ids=rows(following),
                     next_sibling_ids=rows(torch.full_like(node, NO_NODE)))
