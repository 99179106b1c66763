"""The tree layout of one engine step, shared by the runner patches, tree
attention and tree verification.

vLLM's scheduler sees a tree as a flat draft: the N-1 non-root nodes in tree
order (parents before children), so any prefix it keeps (token budget,
max_model_len) is still a tree. The runner writes node i's KV at slot
position `seq_len + i` (vLLM's sequential slot mapping, untouched); we give
it rope position `seq_len + depth(i)`, restrict its attention to the prefix
and its ancestors, verify the tree, then move the accepted path's KV to
`seq_len + 0..a` (KV compaction) so the cache is what the scheduler believes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specplug.verification.tree_masks import ancestor_mask

from vllm_specplug.proposers.eagle3 import chain_parents, is_chain


@dataclass
class TreeRequest:
    row: int  # index in the runner's batch
    req_id: str
    first_token: int  # the root's index among this step's scheduled tokens
    seq_len: int  # the root's position (tokens already in the KV cache)
    parent_ids: np.ndarray  # [num_nodes] int64, root first (-1)
    depths: np.ndarray  # [num_nodes] int64

    is_chain: bool = field(init=False)  # read per attention layer: computed once

    def __post_init__(self) -> None:
        self.is_chain = is_chain(self.parent_ids)

    @property
    def num_nodes(self) -> int:
        return len(self.parent_ids)

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: [i, j] when node j is node i or one of its ancestors."""
        return torch.from_numpy(ancestor_mask(np.asarray(self.parent_ids)[None])[0])


@dataclass
class TreeStep:
    """One step's layout: where each request's tokens sit, and the requests
    that carry drafts (in batch order)."""
    num_tokens: int  # scheduled tokens of the step
    query_starts: np.ndarray  # [num_reqs + 1] int32, each request's first token
    num_computed: np.ndarray  # [num_reqs] int32, tokens in the KV cache before the step
    requests: list[TreeRequest] = field(default_factory=list)
    # Filled by verification: per request, accepted node ids (root first).
    accepted: dict[str, list[int]] = field(default_factory=dict)
    # CPU tree attention's padded batch, built by the first layer that needs
    # it: ((block table pointer, block size), cpu_tree_attention.TreeRows)
    cpu_rows: tuple | None = None

    def verified_rows(self, row: int, request: TreeRequest | None):
        """(token rows of this step, positions) whose K/V is now verified and
        in place: a tree's root and accepted path (compacted), or every
        scheduled token of a request without drafts."""
        if request is not None:
            path = np.asarray(self.accepted.get(request.req_id, [0]), dtype=np.int64)
            return request.first_token + path, request.seq_len + np.arange(len(path))
        first, end = int(self.query_starts[row]), int(self.query_starts[row + 1])
        return (np.arange(first, end, dtype=np.int64),
                int(self.num_computed[row]) + np.arange(end - first, dtype=np.int64))

    def path_ranks(self, width: int) -> tuple[int, np.ndarray] | None:
        """For the batch policy (integration/batch_schedule.py): (drafts
        verified per request, [n, width] the accepted paths' node ranks,
        `width + 1` past each path) of the requests that verified the most
        drafts, or None. On this runner a tree of k drafts is the drafted
        tree's first k nodes (`TreeEagleDrafter._draft`), parents before
        children, so a node ranks by its index: node i ranks i - 1."""
        num_drafts = max((r.num_nodes - 1 for r in self.requests), default=0)
        rows = [r for r in self.requests if r.num_nodes - 1 == num_drafts]
        if num_drafts <= 0:
            return None
        ranks = np.full((len(rows), width), width + 1, dtype=np.int64)
        for i, request in enumerate(rows):
            path = self.accepted.get(request.req_id, [0])[1:]
            ranks[i, :len(path)] = np.asarray(path, dtype=np.int64) - 1
        return num_drafts, ranks

    def masked(self) -> list[TreeRequest]:
        """Requests whose attention differs from causal (not a chain)."""
        return [r for r in self.requests if not r.is_chain]


def depths_of(parent_ids: np.ndarray) -> np.ndarray:
    depths = np.zeros(len(parent_ids), dtype=np.int64)
    for i in range(1, len(parent_ids)):
        depths[i] = depths[parent_ids[i]] + 1
    return depths


def parents_for(stored: tuple[list[int], np.ndarray] | None,
                scheduled: list[int]) -> np.ndarray:
    """Parents of the scheduled drafts: the stored tree's when the scheduler
    kept a prefix of its nodes, else a chain (a draft we did not shape)."""
    num_nodes = len(scheduled) + 1
    if stored is not None and list(stored[0][:len(scheduled)]) == list(scheduled):
        return stored[1][:num_nodes]
    return chain_parents(num_nodes)


def build_step(runner, scheduler_output, trees: dict) -> TreeStep:
    """The step's tree layout from the scheduled drafts and `trees`
    ({req_id: (node token ids, parents)} as drafted); rope positions of the
    drafted tokens are rewritten to seq_len + depth."""
    spec = scheduler_output.scheduled_spec_decode_tokens or {}
    batch = runner.input_batch
    num_reqs = len(batch.req_ids)
    starts = runner.query_start_loc.np[:num_reqs + 1].copy()
    step = TreeStep(int(scheduler_output.total_num_scheduled_tokens), starts,
                    batch.num_computed_tokens_cpu[:num_reqs].copy())
    for row, req_id in enumerate(batch.req_ids):
        drafts = spec.get(req_id)
        if not drafts:
            continue
        parents = parents_for(trees.get(req_id), drafts)
        num_scheduled = int(starts[row + 1] - starts[row])
        first = int(starts[row]) + num_scheduled - len(parents)
        seq_len = int(batch.num_computed_tokens_cpu[row]) + num_scheduled - len(parents)
        step.requests.append(TreeRequest(row, req_id, first, seq_len, parents,
                                         depths_of(parents)))
    for request in step.masked():
        rows = torch.arange(request.first_token, request.first_token + request.num_nodes)
        depths = torch.from_numpy(request.depths).to(runner.positions.dtype)
        runner.positions[rows.to(runner.positions.device)] = (
            request.seq_len + depths).to(runner.positions.device)
    return step
