"""A tree step's rows on Model Runner V2, computed on the device.

Model Runner V2 lays a step out as vLLM's `InputBatch`: request row b has
query rows [query_start[b], query_start[b + 1]) and logits rows
[cu_num_logits[b], cu_num_logits[b + 1]); a request verifying a draft tree of
n nodes has n of each (node i at query row query_start[b] + i). Its tree
lives in per-state-slot buffers (`slot = idx_mapping[b]`), written when it
was drafted. Kernels: `kernels/tree_rows.py`.

- `prepare_tree_rows`: before the forward, rope positions become
  `seq_len + depth` and the tree-attention rows are written
  (`TreeAttentionMetadata`, read by our kernel inside the captured forward).
- `verified_rows`: after verification, each decoding request's verified
  positions (its first query row, then the accepted path) padded to R rows,
  what the drafter ingests: the query row of each (its target hidden state),
  its position, and the token after it; and the root of each request's next
  draft. It can write a padded batch straight into a CUDA graph's inputs.

Both run with no host synchronisation, so a step stays asynchronous.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specplug.verification.backend import Backend, next_power_of_2, resolve_backend
from vllm_specplug.verification.tree_attention import TreeAttentionMetadata


@dataclass
class VerifiedRows:
    """P decoding requests' verified positions, R rows each (the last
    repeated); past the requests, padding repeats the last request."""
    token_rows: torch.Tensor  # [P * R] int64, query row of each position
    positions: torch.Tensor  # [P, R] int64
    next_ids: torch.Tensor  # [P * R] int64, the token after each position
    slots: torch.Tensor  # [P] int64, each request's state slot
    cuts: torch.Tensor  # [P] int64, the first position this step verified
    root_ids: torch.Tensor  # [P] int64, the token sampled after them (next draft's root)
    root_positions: torch.Tensor  # [P] int64, its position

    @classmethod
    def empty(cls, num_padded: int, num_rows: int, device) -> "VerifiedRows":
        rows = lambda *shape: torch.empty(*shape, dtype=torch.int64,  # noqa: E731
                                          device=device)
        return cls(rows(num_padded * num_rows), rows(num_padded, num_rows),
                   rows(num_padded * num_rows), *(rows(num_padded) for _ in range(4)))


def _is_tree_row(b, num_query, num_logits, slot_is_tree, idx_mapping, max_nodes) -> bool:
    return (bool(slot_is_tree[idx_mapping[b]]) and num_logits > 1
            and num_logits == num_query and num_query <= max_nodes)


def prepare_tree_rows_reference(positions, query_start_loc, cu_num_logits, idx_mapping,
                                num_reqs: int, slot_is_tree, slot_depths, slot_bits,
                                out: TreeAttentionMetadata) -> None:
    """Plain-PyTorch specification of `prepare_tree_rows` (in place)."""
    max_nodes = slot_depths.shape[1]
    out.num_nodes.zero_()
    for b in range(num_reqs):
        first = int(query_start_loc[b])
        num_query = int(query_start_loc[b + 1]) - first
        num_logits = int(cu_num_logits[b + 1]) - int(cu_num_logits[b])
        if not _is_tree_row(b, num_query, num_logits, slot_is_tree, idx_mapping, max_nodes):
            continue
        slot = int(idx_mapping[b])
        root = int(positions[first])
        positions[first:first + num_query] = root + slot_depths[slot, :num_query]
        out.first_token[b], out.seq_lens[b], out.num_nodes[b] = first, root, num_query
        out.ancestor_bits[b, :num_query] = slot_bits[slot, :num_query]
        out.ancestor_bits[b, num_query:] = 0


def prepare_tree_rows(positions: torch.Tensor, query_start_loc: torch.Tensor,
                      cu_num_logits: torch.Tensor, idx_mapping: torch.Tensor, num_reqs: int,
                      slot_is_tree: torch.Tensor, slot_depths: torch.Tensor,
                      slot_bits: torch.Tensor, out: TreeAttentionMetadata,
                      backend: Backend = "auto") -> None:
    """Tree positions and tree-attention rows of a step, in place.

    Args:
        positions: [T] int64, the step's rope positions (sequential on entry).
        query_start_loc: [num_reqs + 1] int32; cu_num_logits: [num_reqs + 1] int32.
        idx_mapping: [num_reqs] int64, batch row -> state slot.
        slot_is_tree: [S] int8, slots whose drafts are trees.
        slot_depths: [S, N] int32; slot_bits: [S, N, W] int32 (packed ancestors).
        out: the persistent attention rows, R >= num_reqs rows; rows past
            num_reqs get num_nodes = 0.
    """
    if resolve_backend(backend, positions) == "torch":
        return prepare_tree_rows_reference(positions, query_start_loc, cu_num_logits,
                                           idx_mapping, num_reqs, slot_is_tree, slot_depths,
                                           slot_bits, out)
    from vllm_specplug.kernels.tree_rows import prepare_tree_rows_kernel

    max_nodes, words = slot_bits.shape[1], slot_bits.shape[2]
    prepare_tree_rows_kernel[(out.num_nodes.shape[0],)](
        positions, query_start_loc, cu_num_logits, idx_mapping, slot_is_tree, slot_depths,
        slot_bits, out.first_token, out.seq_lens, out.num_nodes, out.ancestor_bits,
        num_reqs, N=max_nodes, N_PAD=next_power_of_2(max_nodes), W=words)


def rows_per_request(num_query_tokens: int, num_steps: int) -> int:
    """Rows `verified_rows` takes per request after a step that scheduled it
    `num_query_tokens` (its draft length + 1): at most the root and one node
    per draft level, padded to a power of two (one variant a kernel, a
    graph)."""
    return next_power_of_2(min(num_query_tokens, num_steps + 1))


def verified_rows_reference(batch_rows, query_start_loc, seq_lens, num_rejected,
                            cu_num_logits, idx_mapping, accepted_nodes, input_ids,
                            last_sampled, num_rows: int, out: VerifiedRows) -> VerifiedRows:
    """Plain-PyTorch specification of `verified_rows`."""
    count = batch_rows.shape[0]
    token_rows, positions = out.token_rows.view(-1, num_rows), out.positions
    next_ids = out.next_ids.view(-1, num_rows)
    for p in range(out.slots.shape[0]):
        b = int(batch_rows[min(p, count - 1)])
        first = int(query_start_loc[b])
        num_query = int(query_start_loc[b + 1]) - first
        first_position = int(seq_lens[b]) - num_query
        num_verified = num_query - int(num_rejected[b])
        base = num_query - (int(cu_num_logits[b + 1]) - int(cu_num_logits[b]) - 1)
        offsets = list(range(base - 1))  # rows before the root
        path = range(num_verified - base + 1)
        offsets += [base - 1 + (int(accepted_nodes[b, k]) if accepted_nodes is not None
                                else k) for k in path]
        slot = int(idx_mapping[b])
        out.slots[p], out.cuts[p] = slot, first_position
        out.root_ids[p] = int(last_sampled[slot])
        out.root_positions[p] = first_position + num_verified
        for r in range(num_rows):
            j = min(r, num_verified - 1)
            token_rows[p, r] = first + offsets[j]
            positions[p, r] = first_position + j
            next_ids[p, r] = (int(input_ids[first + offsets[j + 1]]) if j + 1 < num_verified
                              else int(last_sampled[slot]))
    return out


def verified_rows(batch_rows: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, num_rejected: torch.Tensor,
                  cu_num_logits: torch.Tensor, idx_mapping: torch.Tensor,
                  accepted_nodes: torch.Tensor | None, input_ids: torch.Tensor,
                  last_sampled: torch.Tensor, num_rows: int, num_padded: int | None = None,
                  out: VerifiedRows | None = None,
                  backend: Backend = "auto") -> VerifiedRows:
    """The verified positions of decoding requests, for the drafter's ingest,
    and the roots of their next drafts.

    Args:
        batch_rows: [P] int64, the batch rows of the requests (each with at
            least one verified position, at most `num_rows`).
        query_start_loc, cu_num_logits: [num_reqs + 1] int32; seq_lens,
            num_rejected: [num_reqs] int32 (vLLM's, after verification).
        accepted_nodes: [num_reqs, N] int64, each tree's accepted path (node
            0 = root), or None for chains (node k at depth k).
        input_ids: [T] int32, the step's input tokens; last_sampled: [S]
            int64, each slot's last sampled token (the bonus).
        num_rows: R, a power of two.
        num_padded: Pp >= P rows of output, the last request repeated past P
            (a capture size); P when None.
        out: where to write (`VerifiedRows.empty(Pp, R)`-shaped, e.g. a CUDA
            graph's inputs); fresh tensors when None.
    """
    num_padded = batch_rows.shape[0] if num_padded is None else num_padded
    if out is None:
        out = VerifiedRows.empty(num_padded, num_rows, input_ids.device)
    if resolve_backend(backend, input_ids) == "torch":
        return verified_rows_reference(batch_rows, query_start_loc, seq_lens, num_rejected,
                                       cu_num_logits, idx_mapping, accepted_nodes, input_ids,
                                       last_sampled, num_rows, out)
    from vllm_specplug.kernels.tree_rows import verified_rows_kernel

    nodes = accepted_nodes if accepted_nodes is not None else out.slots
    verified_rows_kernel[(num_padded,)](
        batch_rows, query_start_loc, seq_lens, num_rejected, cu_num_logits, idx_mapping,
        nodes, input_ids, last_sampled, out.token_rows, out.positions, out.next_ids,
        out.slots, out.cuts, out.root_ids, out.root_positions, batch_rows.shape[0],
        nodes.shape[-1], R=num_rows, USE_NODES=accepted_nodes is not None)
    return out
