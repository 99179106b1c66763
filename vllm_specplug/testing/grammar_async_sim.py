"""Constrained draft trees through vLLM's async engine-core loop, on CPU.

Model Runner V2 runs only on CUDA, and there our tree scheduler's own rows
(`grammar_rows: "scheduler"`) differed from no speculation in 2 of 5 runs
(docs/results/v2_schema_choices_h200). This drives the scheduler side of that
path for many steps without a GPU: vLLM's real `AsyncScheduler` (our
`SpecplugTreeAsyncScheduler`), its structured-output manager with xgrammar,
and the engine core's batch queue of two with its deferred step
(`EngineCore.step_with_batch_queue`: schedule, sample now or defer, take the
drafts, `update_draft_token_ids_in_output`, `get_grammar_bitmask`, sample).

The worker is a script. The target's logits at output position p of request
i are fixed random scores, so greedy decoding under the grammar (the
reference) takes the best-scoring token each row allows. The drafter drafts
a tree per request beside each step's output (the device's copy: the
scheduler sees it only when it takes the drafts), the reference's next
tokens on one path with probability `hit`, other tokens elsewhere. Each
step verifies the tree drafted before it over the scheduler's rows, node by
node as the tree sampler does.
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from vllm_specplug.integration.grammar_trees import TREE_PARENTS_ATTR
from vllm_specplug.verification.grammar_greedy import masked_argmax, unpack_row
from vllm_specplug.verification.tree_greedy import follow_choices

# tokens of the test regex in the tiny model's vocabulary (def, class, " ",
# "(", ")", ",", ":", "):", name, " name", "_") to draft beside random ones
PLAUSIBLE_IDS = (326, 492, 226, 13, 14, 17, 31, 311, 357, 446, 68)
# a tree: 3 children of the root, 2 under the first path node, 2 under the next
NUM_CHILDREN = (3, 2, 2)
NUM_DRAFTS = sum(NUM_CHILDREN)


@dataclass
class Target:
    """The scripted model: fixed random scores per (request, position)."""
    vocab_size: int
    seed: int = 0
    scores: dict = field(default_factory=dict)

    def choice(self, index: int, position: int, row: np.ndarray) -> int:
        key = (index, position)
        if key not in self.scores:
            rng = np.random.default_rng(self.seed * 1_000_003 + index * 10_007 + position)
            self.scores[key] = rng.standard_normal(self.vocab_size)
        return masked_argmax(self.scores[key], unpack_row(row, self.vocab_size))


def reference(target: Target, grammar, index: int, max_tokens: int,
              stop_id: int) -> list[int]:
    """Greedy decoding of request `index` under a fresh `grammar`."""
    import xgrammar as xgr

    out = []
    row = xgr.allocate_token_bitmask(1, target.vocab_size)
    while len(out) < max_tokens:
        grammar.fill_bitmask(row, 0)
        token = target.choice(index, len(out), row[0].numpy())
        out.append(token)
        if token == stop_id or not grammar.accept_tokens(f"ref{index}", [token]):
            break
    return out


@dataclass
class _Request:
    index: int
    ref: list[int]                 # its reference output (the drafter's oracle)
    output: list[int] = field(default_factory=list)
    tree: tuple[list[int], list[int]] | None = None  # (drafts, parents) on the device


class TreeWorker:
    """Samples each step over the scheduler's rows and drafts the next trees."""

    def __init__(self, target: Target, refs: dict[str, list[int]], hit: float,
                 seed: int = 0) -> None:
        self.target, self.hit, self.rng = target, hit, random.Random(seed)
        self.requests = {req_id: _Request(int(req_id), ref) for req_id, ref in refs.items()}
        self.taken: tuple | None = None  # the last drafting pass: (req_ids, drafts, parents)
        self.num_accepted = 0
        self.num_verified_trees = 0  # a request's tree verified (rows for its drafts)

    def sample(self, scheduler_output, grammar_output):
        from vllm.v1.outputs import ModelRunnerOutput

        rows = _rows_by_request(scheduler_output, grammar_output)
        req_ids, sampled = list(scheduler_output.num_scheduled_tokens), []
        for req_id in req_ids:
            request = self.requests[req_id]
            done_prefill = req_id in rows  # a prefill chunk samples nothing
            sampled.append(self._verify(request, *rows[req_id]) if done_prefill else [])
            request.output += sampled[-1]
        drafted = [r for r, s in zip(req_ids, sampled) if s]
        self.taken = (drafted, [self._draft(self.requests[r]) for r in drafted])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def _verify(self, request: _Request, node_rows: np.ndarray, num_acceptable: int):
        """The tree sampler's walk: from the root, the masked choice at each
        node, then the child carrying it if that child is acceptable."""
        drafts, parents = request.tree or ([], [-1])
        num_nodes = min(len(node_rows), num_acceptable + 1)  # the nodes it may accept
        self.num_verified_trees += num_nodes > 1
        depths = iter(range(len(request.output), len(request.output) + num_nodes + 1))
        accepted, out = follow_choices(
            parents[:num_nodes], [0, *drafts][:num_nodes],
            lambda node: self.target.choice(request.index, next(depths), node_rows[node]))
        self.num_accepted += len(accepted) - 1
        return out

    def _draft(self, request: _Request) -> tuple[list[int], list[int]]:
        """A tree of NUM_DRAFTS after the request's output so far."""
        drafts, parents, node = [], [-1], 0
        for depth, num_children in enumerate(NUM_CHILDREN):
            position = len(request.output) + depth
            true = request.ref[position] if position < len(request.ref) else 1
            tokens = [self._other() for _ in range(num_children)]
            if self.rng.random() < self.hit:
                tokens[self.rng.randrange(num_children)] = true
            first = len(drafts) + 1
            drafts += tokens
            parents += [node] * num_children
            # the next level under the path's node when drafted, else the first
            node = first + (tokens.index(true) if true in tokens else 0)
        request.tree = (drafts, parents)
        return drafts, parents

    def _other(self) -> int:
        if self.rng.random() < 0.7:
            return self.rng.choice(PLAUSIBLE_IDS)
        return self.rng.randrange(2, self.target.vocab_size)

    def take_drafts(self):
        from vllm.v1.outputs import DraftTokenIds

        req_ids, trees = self.taken or ([], [])
        drafts = DraftTokenIds(list(req_ids), [list(d) for d, _ in trees])
        setattr(drafts, TREE_PARENTS_ATTR, {r: list(p) for r, (_, p) in zip(req_ids, trees)})
        return drafts


def _rows_by_request(scheduler_output, grammar_output) -> dict:
    """{req_id: (rows [num_nodes, words], num_acceptable drafts)} as the worker
    maps the scheduler's bitmask: rows in the id list's order, 1 + spec a request."""
    if grammar_output is None:
        return {}
    spec = scheduler_output.scheduled_spec_decode_tokens
    found, offset = {}, 0
    for req_id, acceptable in zip(grammar_output.structured_output_request_ids,
                                  grammar_output.num_acceptable_drafts):
        num_rows = 1 + len(spec.get(req_id, ()))
        found[req_id] = (grammar_output.grammar_bitmask[offset:offset + num_rows], acceptable)
        offset += num_rows
    return found


def run(scheduler, worker: TreeWorker) -> dict[str, list[int]]:
    """The engine core's loop with a batch queue of two and the deferred
    step; returns each request's output as the scheduler emitted it."""
    queue: deque = deque()
    outputs: dict[str, list[int]] = {}
    while scheduler.has_requests() or queue:
        deferred = None
        if scheduler.has_requests():
            scheduler_output = scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                if not scheduler_output.pending_structured_output_tokens:
                    grammar_output = scheduler.get_grammar_bitmask(scheduler_output)
                    queue.appendleft((scheduler_output,
                                      worker.sample(scheduler_output, grammar_output)))
                    if len(queue) < 2:
                        continue
                else:
                    deferred = scheduler_output
        if not queue:
            time.sleep(0.01)  # a grammar still compiling
            continue
        scheduler_output, model_output = queue.pop()
        for engine_outputs in scheduler.update_from_output(scheduler_output,
                                                           model_output).values():
            for out in engine_outputs.outputs:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if deferred is not None:
            scheduler.update_draft_token_ids_in_output(worker.take_drafts(), deferred)
            grammar_output = scheduler.get_grammar_bitmask(deferred)
            queue.appendleft((deferred, worker.sample(deferred, grammar_output)))
    return outputs
