"""Per-step tree sizes for head drafters (EAGLE-3 and MTP trees and chains),
from live acceptance and measured costs (issue 27).

A drafted tree lists its nodes parents first, so keeping the first n nodes
of the list keeps a tree. Node j is accepted exactly when its whole path
is, whatever else is kept, so the tokens a request gains from its first n
nodes are, in expectation, the sum of P(node j accepted) over j < n (a
chain is the tree whose node j is at depth j + 1). Those probabilities are
counted per list index over every verified tree (`NodeCounts`: faded once
a step, so the memory is in steps whatever the batch), and scaled per
request by how its own recent trees did against that estimate (acceptance
comes in runs).

A step of B requests that keeps n_i nodes each yields B + sum of the kept
probabilities and costs `fixed + per_token * T` (T = B + sum n_i verified
tokens: `StepCostModel`, fitted on the times of steps that verified drafts,
less the drafting pass) plus the drafting pass itself, paid only when some
request drafts (`draft_cost`, fitted on its own times against B). The
sizes come from the same greedy rule as the model-free controller's
(`policy.py`), with the drafting pass counted in the fixed part; then the
step with drafts is compared with the step without, and the drafting pass
is skipped when it does not pay. Because that decision comes before the
trees exist, it uses the engine-wide estimates.

The step without drafts has a line of its own (`plain_cost`), fitted on
steps that verified none: a speculative step carries costs that do not grow
with its tokens (tree layout, verification, the sampler's extra rows), and
one line through both kinds of step would charge them to the step without
drafts too (on CPU it kept whole trees at batch 1, where skipping was 1.4x
faster). Until that line is measured, and now and then after, one step in
`SKIP_PROBE_EVERY` skips the drafting pass to measure it (a skip probe).

K = 0 steps stay correct: the head ingests every verified position whether
or not it drafted, a request that skips drafting in one pass when it drafts
again (`TreeEagleDrafter._ingest`, integration/v1/deferred_ingest.py), so
its state never depends on what was skipped (the trap TensorRT-LLM hit,
#16888). A controller that
skips every step learns nothing, so after `probe_wait` skipped steps in a
row one step drafts whole trees; each probe that does not revive
speculation doubles the wait (up to 8x).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vllm_specplug.adaptive.cost_model import StepCostModel
from vllm_specplug.adaptive.policy import choose_draft_lengths

# prior acceptance of a node never verified: optimistic, so new trees get tried
PRIOR_RATE = 0.5
PRIOR_WEIGHT = 2.0  # in verified trees


@dataclass
class NodeCounts:
    """Decayed counts per node index: kept in a verified tree, and accepted."""
    accepted: np.ndarray  # [num_nodes] float64
    tried: np.ndarray  # [num_nodes] float64

    @classmethod
    def zeros(cls, num_nodes: int) -> "NodeCounts":
        return cls(np.zeros(num_nodes), np.zeros(num_nodes))

    def add(self, num_kept: int, accepted_nodes: list[int], decay: float = 1.0) -> None:
        """One verified tree of `num_kept` nodes (root excluded) whose
        accepted path is `accepted_nodes` (node indices from 0, root
        excluded), after decaying what came before by `decay`."""
        self.fade(decay)
        self.tried[:min(num_kept, len(self.tried))] += 1.0
        for node in accepted_nodes:
            if node < len(self.accepted):
                self.accepted[node] += 1.0

    def fade(self, decay: float) -> None:
        self.accepted *= decay
        self.tried *= decay

    def rates(self) -> np.ndarray:
        """[num_nodes] float64: P(node j accepted), shrunk toward PRIOR_RATE."""
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)


def non_increasing(values: np.ndarray) -> np.ndarray:
    """The closest non-increasing sequence in least squares (pool adjacent
    violators): a later node more likely than an earlier one is pooled with
    it, so prefix sums at block ends are kept and the greedy rule applies."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values.tolist():
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-1][0] / blocks[-1][1] > blocks[-2][0] / blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), s / c) for s, c in blocks]) if blocks else values


@dataclass
class TreeBudgetStats:
    """What the budget decided and how it turned out (bench, logs); the keys
    of the model-free controller's `AdaptiveStats`, plus skipped passes."""
    num_steps: int = 0  # steps with at least one request that could draft
    num_skipped: int = 0  # of which the drafting pass was skipped
    num_probes: int = 0  # steps that drafted a whole tree after a skipped streak
    num_skip_probes: int = 0  # steps skipped to measure the step without drafts
    # set by the V1 drafter: verified rows whose head ingest waited for a
    # drafting step (integration/v1/deferred_ingest.py), and of those the
    # rows never ingested (their request ended first)
    num_deferred_rows: int = 0
    num_dropped_rows: int = 0
    num_requests: int = 0  # requests that could draft, over all steps
    num_offered: int = 0  # nodes their configured trees would have had
    num_kept: int = 0  # nodes kept
    num_zero: int = 0  # requests that kept none
    expected_accepted: float = 0.0  # sum of the kept nodes' estimates
    num_verified_drafts: int = 0  # kept trees whose verification was seen
    num_accepted: int = 0  # their accepted nodes

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["mean_kept_per_request"] = self.num_kept / max(self.num_requests, 1)
        return out


# skip probes: one step in this many while the step without drafts has fewer
# than PLAIN_WARMUP samples, then one in SKIP_PROBE_EVERY[1]
SKIP_PROBE_EVERY = (8, 128)
PLAIN_WARMUP = 3


class TreeBudget:
    def __init__(self, num_nodes: int, decay: float = 0.98, request_decay: float = 0.8,
                 probe_wait: int = 8, clock: Callable[[], float] = time.perf_counter) -> None:
        self.num_nodes = num_nodes  # nodes of the configured tree, root excluded
        self.decay, self.request_decay = decay, request_decay
        self.counts = NodeCounts.zeros(num_nodes)
        self.cost = StepCostModel()  # steps that verified drafts, drafting pass excluded
        self.plain_cost = StepCostModel(num_warmup=PLAIN_WARMUP)  # steps that verified none
        self.steps_since_plain = 0  # drafting passes since the last step without drafts
        self.draft_cost = StepCostModel()  # seconds of a drafting pass against its requests
        self.stats = TreeBudgetStats()
        # req_id -> its own verified trees' counts, decayed per tree
        self.requests: dict[str, NodeCounts] = {}
        self.probe_wait = self.wait = probe_wait
        self.skip_streak = 0
        self.clock = clock
        self.last_step_time: float | None = None
        self.last_draft_seconds = 0.0

    def step_done(self, num_tokens: int, num_draft_tokens: int) -> None:
        """The step just run verified `num_tokens` tokens, `num_draft_tokens`
        of them drafts; its time is the wall time since the last call, less
        the drafting pass in between."""
        now = self.clock()
        if self.last_step_time is not None and num_tokens > 0:
            line = self.cost if num_draft_tokens > 0 else self.plain_cost
            line.observe(num_tokens, now - self.last_step_time - self.last_draft_seconds)
        self.last_step_time, self.last_draft_seconds = now, 0.0

    def verified(self, req_id: str, num_kept: int, accepted_nodes: list[int]) -> None:
        """A request's tree of `num_kept` nodes was verified; `accepted_nodes`
        its accepted path (node indices from 0, root excluded)."""
        if num_kept <= 0:
            return
        self.counts.add(num_kept, accepted_nodes)  # faded once a step, in `plan`
        mine = self.requests.setdefault(req_id, NodeCounts.zeros(self.num_nodes))
        mine.add(num_kept, accepted_nodes, self.request_decay)
        self.stats.num_verified_drafts += 1
        self.stats.num_accepted += len(accepted_nodes)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def node_rates(self, req_id: str, engine_rates: np.ndarray | None = None) -> np.ndarray:
        """[num_nodes] P(node j accepted) for this request, non-increasing:
        the engine-wide rates (`engine_rates`, computed once a step by the
        caller), scaled by how the request's own recent trees did against
        them (measured with today's rates, so a scale is never stale)."""
        rates = self.counts.rates() if engine_rates is None else engine_rates
        mine = self.requests.get(req_id)
        if mine is not None:
            expected = float(mine.tried @ rates)
            scale = (mine.accepted.sum() + PRIOR_WEIGHT) / (expected + PRIOR_WEIGHT)
            rates = np.minimum(rates * scale, 1.0)
        return non_increasing(rates)

    def plan(self, req_ids: list[str], num_reqs: int, max_nodes: int) -> list[int]:
        """Nodes to keep per drafting request (all 0: skip the drafting pass);
        `num_reqs` counts every request of the step."""
        engine_rates = self.counts.rates()
        rates = [self.node_rates(r, engine_rates)[:max_nodes] for r in req_ids]
        fixed, per_token = self.cost.coefficients()
        draft_fixed, draft_per_req = self.draft_cost.coefficients()
        drafting = draft_fixed + draft_per_req * len(req_ids)
        if self.draft_cost.num_samples < self.draft_cost.num_warmup:
            drafting = 0.0  # not measured yet: draft, and learn its cost
        sizes = choose_draft_lengths(rates, num_reqs, 0, fixed + drafting, per_token)
        gained = sum(float(r[:n].sum()) for r, n in zip(rates, sizes))
        with_drafts = (num_reqs + gained) / (fixed + drafting + per_token * (num_reqs + sum(sizes)))
        if not any(sizes) or with_drafts <= self._without_drafts(num_reqs):
            sizes = self._probe([0] * len(req_ids), max_nodes)
        elif self._skip_probe_due():
            sizes = [0] * len(req_ids)
            self.stats.num_skip_probes += 1
        else:
            self.skip_streak, self.wait = 0, self.probe_wait
        self.steps_since_plain = 0 if not any(sizes) else self.steps_since_plain + 1
        self._count(rates, sizes, max_nodes)
        # the engine-wide counts fade per step, not per tree: at 64 trees a
        # step a per-tree decay of 0.98 remembered under one step, and nodes
        # kept now and then were estimated from a handful of trees (the 8B
        # projection kept 3.4 nodes where 1 was best)
        self.counts.fade(self.decay)
        return sizes

    def _without_drafts(self, num_reqs: int) -> float:
        """Tokens per second of a step that verifies no drafts: its own line
        once measured, else the speculative line (which overrates it)."""
        line = self.plain_cost if self.plain_cost.num_samples >= PLAIN_WARMUP else self.cost
        return num_reqs / line.predict(num_reqs)

    def _skip_probe_due(self) -> bool:
        """Whether this step should skip drafting to measure the step without."""
        every = SKIP_PROBE_EVERY[self.plain_cost.num_samples >= PLAIN_WARMUP]
        return self.cost.num_samples >= self.cost.num_warmup and self.steps_since_plain >= every

    def _probe(self, sizes: list[int], max_nodes: int) -> list[int]:
        """After `wait` skipped steps in a row, one request (in turn) drafts
        its whole tree, so the estimates stay current."""
        self.skip_streak += 1
        if self.skip_streak < self.wait:
            return sizes
        self.skip_streak, self.wait = 0, min(2 * self.wait, 8 * self.probe_wait)
        sizes[self.stats.num_probes % len(sizes)] = max_nodes
        self.stats.num_probes += 1
        return sizes

    def drafted(self, num_requests: int, seconds: float) -> None:
        """The drafting pass for `num_requests` requests took `seconds`."""
        self.draft_cost.observe(num_requests, seconds)
        self.last_draft_seconds += seconds

    def _count(self, rates, sizes: list[int], max_nodes: int) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_skipped += not any(sizes)
        s.num_requests += len(sizes)
        s.num_offered += max_nodes * len(sizes)
        s.num_kept += sum(sizes)
        s.num_zero += sum(1 for n in sizes if n == 0)
        s.expected_accepted += sum(float(r[:n].sum()) for r, n in zip(rates, sizes))

    def as_dict(self) -> dict:
        fixed, per_token = self.cost.coefficients()
        draft_fixed, draft_per_req = self.draft_cost.coefficients()
        plain_fixed, plain_per_token = self.plain_cost.coefficients()
        return {**self.stats.as_dict(), "cost_fixed_ms": fixed * 1e3,
                "cost_per_token_ms": per_token * 1e3, "plain_fixed_ms": plain_fixed * 1e3,
                "plain_per_token_ms": plain_per_token * 1e3, "draft_fixed_ms": draft_fixed * 1e3,
                "draft_per_request_ms": draft_per_req * 1e3,
                "node_acceptance": np.round(self.counts.rates(), 4).tolist()}
