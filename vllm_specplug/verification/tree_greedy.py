"""Greedy verification of draft trees and chains.

Starting at the root, follow the child whose token equals the target's argmax
at the current node; the walk stops where no child matches, and the target's
argmax there is the bonus token. The output is exactly what plain greedy
decoding of the target would produce, one token per accepted node plus one.
"""
from __future__ import annotations

import torch

from vllm_specplug.verification import checks
from vllm_specplug.verification.backend import Backend, resolve_backend
from vllm_specplug.verification.metadata import (NO_NODE, PLACEHOLDER_TOKEN_ID,
                                                 DraftTree, VerifyOutput,
                                                 empty_verify_output)


def _greedy_path(tokens, first_child, next_sibling, argmax) -> list[int]:
    path = [0]
    while True:
        child = first_child[path[-1]]
        while child != NO_NODE and tokens[child] != argmax[path[-1]]:
            child = next_sibling[child]
        if child == NO_NODE:
            return path
        path.append(child)


def follow_choices(parents, token_ids, choose) -> tuple[list[int], list[int]]:
    """The greedy walk over one tree in plain Python (the readable form the
    tests, benchmarks and simulations share): from the root, `choose(node)`
    is the target's token after `node`, and the walk moves to the child
    carrying it. `parents` [N] (-1 at the root), `token_ids` [N] (node i's
    token; the root's unused). Returns (accepted node ids, root first; the
    tokens emitted, the bonus last)."""
    node, accepted, emitted = 0, [0], []
    while True:
        token = choose(node)
        emitted.append(token)
        child = next((c for c in range(1, len(parents))
                      if parents[c] == node and token_ids[c] == token), None)
        if child is None:
            return accepted, emitted
        accepted.append(child)
        node = child


def verify_tree_greedy_reference(tree: DraftTree, target_argmax: torch.Tensor) -> VerifyOutput:
    """Plain-PyTorch specification; `target_argmax` [B, N] int64."""
    batch, num_nodes = tree.token_ids.shape
    out = empty_verify_output(batch, num_nodes, tree.token_ids.device)
    for b in range(batch):
        tokens, argmax = tree.token_ids[b].tolist(), target_argmax[b].tolist()
        path = _greedy_path(tokens, tree.first_child_ids[b].tolist(),
                            tree.next_sibling_ids[b].tolist(), argmax)
        emitted = [tokens[n] for n in path[1:]] + [argmax[path[-1]]]
        out.output_token_ids[b, :len(emitted)] = torch.tensor(emitted)
        out.accepted_node_ids[b, :len(path)] = torch.tensor(path)
        out.num_accepted[b] = len(path) - 1
    return out


def verify_chain_greedy_reference(draft_token_ids: torch.Tensor,
                                  target_argmax: torch.Tensor) -> VerifyOutput:
    """Chain special case: drafts [B, K], target argmax [B, K+1]."""
    batch, num_drafts = draft_token_ids.shape
    matches = (draft_token_ids == target_argmax[:, :num_drafts]).long()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    out = empty_verify_output(batch, num_drafts + 1, draft_token_ids.device)
    positions = torch.arange(num_drafts + 1, device=draft_token_ids.device)
    emitted = torch.where(positions[None, :num_drafts] < num_accepted[:, None],
                          draft_token_ids, PLACEHOLDER_TOKEN_ID)
    out.output_token_ids[:, :num_drafts] = emitted
    out.output_token_ids.scatter_(1, num_accepted[:, None],
                                  target_argmax.gather(1, num_accepted[:, None]))
    out.num_accepted = num_accepted
    out.accepted_node_ids = torch.where(positions[None] <= num_accepted[:, None],
                                        positions[None], NO_NODE)
    return out


def check_tree(tree: DraftTree, vocab_size: int | None = None) -> tuple[int, int]:
    """Shapes, dtypes, parent order and token range of a tree; returns (B, N)."""
    checks.check_shape("tree.token_ids", tree.token_ids, (None, None))
    batch, num_nodes = tree.token_ids.shape
    for name in ("parent_ids", "first_child_ids", "next_sibling_ids"):
        checks.check_shape(f"tree.{name}", getattr(tree, name), (batch, num_nodes))
        checks.check_dtype(f"tree.{name}", getattr(tree, name), (torch.int64,))
    checks.check_dtype("tree.token_ids", tree.token_ids, (torch.int64,))
    if (tree.parent_ids[:, 0] != NO_NODE).any():
        raise checks.VerificationInputError("tree.parent_ids[:, 0] must be -1 (root)")
    checks.check_parents_earlier("tree.parent_ids", tree.parent_ids[:, 1:], NO_NODE,
                                 first_index=1)
    if vocab_size is not None:
        checks.check_range("tree.token_ids", tree.token_ids, 0, vocab_size)
    return batch, num_nodes


def _check_greedy_inputs(tree: DraftTree, target_argmax: torch.Tensor) -> None:
    batch, num_nodes = check_tree(tree)
    checks.check_shape("target_argmax", target_argmax, (batch, num_nodes))
    checks.check_dtype("target_argmax", target_argmax, (torch.int64,))
    checks.check_range("target_argmax", target_argmax, 0, 2**62)
    checks.check_same_device(tree=tree.token_ids, target_argmax=target_argmax)


def verify_tree_greedy(tree: DraftTree, target_argmax: torch.Tensor,
                       backend: Backend = "auto", validate: bool = True) -> VerifyOutput:
    """Greedy tree verification.

    Args:
        tree: N-node draft tree (`build_draft_tree`).
        target_argmax: [B, N] int64, the target's argmax at every node.
        validate: check inputs first (host syncs).
    Returns:
        VerifyOutput: accepted tokens + bonus, their count, the accepted path.
    """
    if validate:
        _check_greedy_inputs(tree, target_argmax)
    if resolve_backend(backend, target_argmax) == "torch":
        return verify_tree_greedy_reference(tree, target_argmax)
    from vllm_specplug.verification.tree_verify_triton import verify_tree_greedy_triton

    return verify_tree_greedy_triton(tree, target_argmax)
