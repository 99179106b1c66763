"""Greedy tree verification read straight from a runner's flat logits rows.

Model Runner V2 hands the sampler one logits row per scheduled tree node
(root first) in `cu_num_logits` layout, with the nodes' tokens in its input
ids; the tree's shape lives in the drafter's per-slot parents. The plain
route gathers [B, N] token, parent and argmax tables, builds a `DraftTree`
and verifies it (about twenty small launches, docs/results/v2_tree_h100);
the kernel does the gathers and the walk in one program per request and
writes the accepted path straight into the caller's buffer.

Request b's node n is row `cu_num_logits[b] + n`; nodes past its row count
were not scheduled (the scheduler cut the tree) and are never accepted, nor
are nodes past what its slot's last tree had (`slot_num_nodes`): when the
batch shrinks, vLLM's dynamic speculative decoding schedules more rows than
that smaller tree drafted, and those rows hold stale or padding tokens.
"""
from __future__ import annotations

import torch

from vllm_specplug.verification.backend import Backend, next_power_of_2, resolve_backend
from vllm_specplug.verification.metadata import VerifyOutput
from vllm_specplug.verification.tree_build import tree_from_parents
from vllm_specplug.verification.tree_greedy import verify_tree_greedy_reference


def node_rows(cu_num_logits: torch.Tensor, num_reqs: int, num_nodes: int,
              drafted: torch.Tensor | None = None):
    """Each request's logits row per node [B, N] int64 (past its own nodes:
    its last row), and its node count [B] int64: its rows, at most
    `drafted` [B] (the nodes its tree had) when given."""
    cu = cu_num_logits[:num_reqs + 1].long()
    counts = cu[1:] - cu[:-1]
    if drafted is not None:
        counts = torch.minimum(counts, drafted.long())
    node = torch.arange(num_nodes, device=cu.device)
    return cu[:-1, None] + torch.minimum(node[None], counts[:, None] - 1), counts


def verify_tree_greedy_rows_reference(target_argmax, input_ids, logits_indices,
                                      cu_num_logits, parents, idx_mapping,
                                      slot_num_nodes) -> VerifyOutput:
    """Plain-PyTorch specification: gather the trees, verify them."""
    num_reqs, num_nodes = idx_mapping.shape[0], parents.shape[1]
    idx = idx_mapping.long()
    rows, counts = node_rows(cu_num_logits, num_reqs, num_nodes, slot_num_nodes[idx])
    tokens = input_ids[logits_indices[rows]].long()
    tree = tree_from_parents(tokens, parents[idx], counts,
                             torch.zeros_like(counts))
    return verify_tree_greedy_reference(tree, target_argmax[rows])


def verify_tree_greedy_rows(target_argmax: torch.Tensor, input_ids: torch.Tensor,
                            logits_indices: torch.Tensor, cu_num_logits: torch.Tensor,
                            parents: torch.Tensor, idx_mapping: torch.Tensor,
                            accepted_node_ids: torch.Tensor | None = None, *,
                            slot_num_nodes: torch.Tensor,
                            backend: Backend = "auto") -> VerifyOutput:
    """Greedy verification of every request's tree, from flat rows.

    Args:
        target_argmax: [num_logits] int64, the target's argmax per logits row.
        input_ids: [num_tokens] int32, the step's input tokens.
        logits_indices: [num_logits] int32/int64, the token row of each logits row.
        cu_num_logits: [>= B + 1] int32, logits rows per request, cumulated.
        parents: [S, N] int64, each state slot's tree (parents before children).
        idx_mapping: [B] int32/int64, each request's state slot.
        accepted_node_ids: optional [B, N] int64 buffer the path is written to
            (and returned as the output's `accepted_node_ids`).
        slot_num_nodes: [S] int32, the nodes of each slot's last tree (root
            included); nodes past it are cut.
    Returns:
        VerifyOutput: accepted tokens + bonus, their count, the accepted path.
    """
    if resolve_backend(backend, target_argmax) == "torch":
        out = verify_tree_greedy_rows_reference(target_argmax, input_ids, logits_indices,
                                                cu_num_logits, parents, idx_mapping,
                                                slot_num_nodes)
        if accepted_node_ids is not None:
            accepted_node_ids.copy_(out.accepted_node_ids)
            out.accepted_node_ids = accepted_node_ids
        return out
    from vllm_specplug.kernels.tree_verify import verify_tree_greedy_rows_kernel

    num_reqs, num_nodes = idx_mapping.shape[0], parents.shape[1]
    device = target_argmax.device
    if accepted_node_ids is None:
        accepted_node_ids = torch.empty(num_reqs, num_nodes, dtype=torch.int64, device=device)
    out = VerifyOutput(
        output_token_ids=torch.empty(num_reqs, num_nodes, dtype=torch.int64, device=device),
        num_accepted=torch.empty(num_reqs, dtype=torch.int64, device=device),
        accepted_node_ids=accepted_node_ids)
    if num_reqs == 0:
        return out
    verify_tree_greedy_rows_kernel[(num_reqs,)](
        target_argmax, input_ids, logits_indices, cu_num_logits, parents.contiguous(),
        idx_mapping, slot_num_nodes, out.output_token_ids, out.num_accepted,
        accepted_node_ids, num_nodes, N_PAD=next_power_of_2(num_nodes))
    return out

