"""Lossless stochastic verification: recursive rejection sampling over trees,
and the standard chain rejection sampler as a special case.

Tree ("target only", the draft's tokens are deterministic proposals; SpecInfer
arXiv 2305.09781, EAGLE-2 arXiv 2406.16858): at node `cur` with target
distribution p, children are tried in node order; child t is accepted with
probability p(t) / m, where m is the residual mass left after the rejected
siblings (m starts at 1 and loses p(t) on each rejection). If every child is
rejected, the emitted token is sampled from p with the rejected tokens zeroed.
By induction each emitted token is distributed exactly as p.

Chain (Leviathan et al. arXiv 2211.17192): draft token x ~ q is accepted with
probability min(1, p(x) / q(x)); on rejection the token is sampled from
max(p - q, 0); after K acceptances the bonus token is sampled from p_K.

Randomness is an input, so kernel and reference give identical tokens:
`uniform_samples` decide acceptances and the residual sample is
argmax(r / exp_samples) with exp_samples ~ Exp(1), i.e. a sample from r / sum(r).
"""
from __future__ import annotations

import torch

from vllm_specplug.verification import checks
from vllm_specplug.verification.backend import Backend, resolve_backend
from vllm_specplug.verification.metadata import DraftTree, VerifyOutput
from vllm_specplug.verification.metadata import empty_verify_output
from vllm_specplug.verification.tree_greedy import check_tree


def _record_acceptance(out: VerifyOutput, accept, node, token) -> None:
    rows = accept.nonzero(as_tuple=True)[0]
    out.output_token_ids[rows, out.num_accepted[rows]] = token[rows]
    out.num_accepted[rows] += 1
    out.accepted_node_ids[rows, out.num_accepted[rows]] = node[rows]


def verify_tree_stochastic_reference(tree: DraftTree, target_probs: torch.Tensor,
                                     uniform_samples: torch.Tensor,
                                     exp_samples: torch.Tensor) -> VerifyOutput:
    """Plain-PyTorch specification of `verify_tree_stochastic`."""
    batch, num_nodes = tree.token_ids.shape
    rows = torch.arange(batch, device=target_probs.device)
    out = empty_verify_output(batch, num_nodes, target_probs.device)
    out.accepted_node_ids[:, 0] = 0
    cur = torch.zeros(batch, dtype=torch.long, device=target_probs.device)
    mass = torch.ones(batch, dtype=target_probs.dtype, device=target_probs.device)
    for i in range(1, num_nodes):  # children come after parents, in try order
        token = tree.token_ids[:, i]
        is_child = tree.parent_ids[:, i] == cur
        p = target_probs[rows, cur, token]
        accept = is_child & (uniform_samples[:, i] * mass < p)
        mass = torch.where(is_child & ~accept, mass - p, mass)
        mass = torch.where(accept, torch.ones_like(mass), mass)
        _record_acceptance(out, accept, torch.full_like(cur, i), token)
        cur = torch.where(accept, i, cur)
    residual = target_probs[rows, cur].clone()
    child_rows, child_nodes = (tree.parent_ids == cur[:, None]).nonzero(as_tuple=True)
    residual[child_rows, tree.token_ids[child_rows, child_nodes]] = 0.0
    out.output_token_ids[rows, out.num_accepted] = (residual / exp_samples).argmax(-1)
    return out


def rejection_sample_chain_reference(draft_token_ids, num_draft_tokens, draft_probs,
                                     target_probs, uniform_samples, exp_samples
                                     ) -> VerifyOutput:
    """Plain-PyTorch specification of `rejection_sample_chain`."""
    batch, max_drafts = draft_token_ids.shape
    rows = torch.arange(batch, device=target_probs.device)
    out = empty_verify_output(batch, max_drafts + 1, target_probs.device)
    out.accepted_node_ids[:, 0] = 0
    going = torch.ones(batch, dtype=torch.bool, device=target_probs.device)
    for i in range(max_drafts):
        token = draft_token_ids[:, i]
        going &= i < num_draft_tokens
        p = target_probs[rows, i, token]
        q = draft_probs[rows, i, token]
        accept = going & (uniform_samples[:, i] * q < p)
        _record_acceptance(out, accept, torch.full_like(token, i + 1), token)
        going &= accept
    at = out.num_accepted
    rejected = at < num_draft_tokens
    p_row = target_probs[rows, at]
    q_row = draft_probs[rows, at.clamp(max=max_drafts - 1)]
    residual = torch.where(rejected[:, None], (p_row - q_row).clamp(min=0), p_row)
    out.output_token_ids[rows, at] = (residual / exp_samples).argmax(-1)
    return out


def _check_probs(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    checks.check_shape(name, tensor, shape)
    checks.check_dtype(name, tensor, (torch.float32,))


def _check_tree_inputs(tree, target_probs, uniform_samples, exp_samples) -> None:
    batch, num_nodes = check_tree(tree)
    _check_probs("target_probs", target_probs, (batch, num_nodes, None))
    vocab_size = target_probs.shape[2]
    _check_probs("uniform_samples", uniform_samples, (batch, num_nodes))
    _check_probs("exp_samples", exp_samples, (batch, vocab_size))
    checks.check_range("tree.token_ids", tree.token_ids, 0, vocab_size)
    checks.check_siblings_distinct(tree.token_ids, tree.parent_ids)
    checks.check_same_device(tree=tree.token_ids, target_probs=target_probs,
                             uniform_samples=uniform_samples, exp_samples=exp_samples)


def _check_chain_inputs(draft_token_ids, num_draft_tokens, draft_probs, target_probs,
                        uniform_samples, exp_samples) -> None:
    checks.check_shape("draft_token_ids", draft_token_ids, (None, None))
    batch, max_drafts = draft_token_ids.shape
    checks.check_dtype("draft_token_ids", draft_token_ids, (torch.int64,))
    checks.check_shape("num_draft_tokens", num_draft_tokens, (batch,))
    checks.check_dtype("num_draft_tokens", num_draft_tokens, (torch.int64,))
    checks.check_range("num_draft_tokens", num_draft_tokens, 0, max_drafts + 1)
    _check_probs("draft_probs", draft_probs, (batch, max_drafts, None))
    vocab_size = draft_probs.shape[2]
    _check_probs("target_probs", target_probs, (batch, max_drafts + 1, vocab_size))
    _check_probs("uniform_samples", uniform_samples, (batch, max_drafts))
    _check_probs("exp_samples", exp_samples, (batch, vocab_size))
    checks.check_range("draft_token_ids", draft_token_ids, 0, vocab_size)
    checks.check_same_device(draft_token_ids=draft_token_ids, target_probs=target_probs,
                             draft_probs=draft_probs, exp_samples=exp_samples)


def verify_tree_stochastic(tree: DraftTree, target_probs: torch.Tensor,
                           uniform_samples: torch.Tensor, exp_samples: torch.Tensor,
                           backend: Backend = "auto", num_splits: int | None = None,
                           validate: bool = True) -> VerifyOutput:
    """Lossless stochastic tree verification.

    Args:
        tree: N-node draft tree; siblings must carry distinct tokens.
        target_probs: [B, N, V] float32, the target's distribution at every
            node after temperature / top-k / top-p, each row summing to 1.
        uniform_samples: [B, N] float32 in [0, 1), one per node.
        exp_samples: [B, V] float32, Exp(1) noise for the residual sample.
        num_splits: vocabulary slices per request (Triton only; auto if None).
        validate: check inputs first (host syncs).
    """
    if validate:
        _check_tree_inputs(tree, target_probs, uniform_samples, exp_samples)
    if resolve_backend(backend, target_probs) == "torch":
        return verify_tree_stochastic_reference(tree, target_probs, uniform_samples,
                                                exp_samples)
    from vllm_specplug.verification.sampling_triton import verify_tree_stochastic_triton

    return verify_tree_stochastic_triton(tree, target_probs, uniform_samples,
                                         exp_samples, num_splits)


def rejection_sample_chain(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                           draft_probs: torch.Tensor, target_probs: torch.Tensor,
                           uniform_samples: torch.Tensor, exp_samples: torch.Tensor,
                           backend: Backend = "auto", num_splits: int | None = None,
                           validate: bool = True) -> VerifyOutput:
    """Standard chain rejection sampling with variable-length drafts.

    Args:
        draft_token_ids: [B, K] int64 (entries past num_draft_tokens ignored).
        num_draft_tokens: [B] int64 in [0, K].
        draft_probs: [B, K, V] float32, the draft distribution each token came from.
        target_probs: [B, K+1, V] float32; row num_draft_tokens[b] gives the bonus.
        uniform_samples: [B, K] float32; exp_samples: [B, V] float32 ~ Exp(1).
        validate: check inputs first (host syncs).
    """
    if validate:
        _check_chain_inputs(draft_token_ids, num_draft_tokens, draft_probs,
                            target_probs, uniform_samples, exp_samples)
    args = (draft_token_ids, num_draft_tokens, draft_probs, target_probs,
            uniform_samples, exp_samples)
    if resolve_backend(backend, target_probs) == "torch":
        return rejection_sample_chain_reference(*args)
    from vllm_specplug.verification.sampling_triton import rejection_sample_chain_triton

    return rejection_sample_chain_triton(*args, num_splits)
