"""The adaptive controller a proposer session drives each step.

Per step, in the order a runner adapter calls it:
1. `step_done(num_tokens)`: the step just run verified `num_tokens` tokens;
   the wall time since the last call is its cost (`StepCostModel`).
2. `verified(req_id, num_new)`: a request's accepted tokens (drafts plus the
   bonus token) after its kept draft was verified (`AcceptanceEstimator`).
3. `trim(req_ids, drafts, num_reqs, confidences)`: each request's draft cut
   to the length that maximises expected tokens per second (`policy.py`),
   down to none; the proposer's per-token confidences, where it gives them,
   calibrate the acceptance estimate (`acceptance.py`).

The proposer still drafts every step and hears every accepted token, so its
state never depends on what was cut (the K=0 trap TensorRT-LLM hit: drafter
state out of step after steps without drafts, issue 27). A request cut to
nothing for `probe_interval` steps in a row gets one draft token, so its
acceptance estimate stays current. That needs a request to live that
long; where none does (a server answering short requests), a step in which
every request was cut is followed by more such steps with nothing learned.
So after `global_probe_interval` steps in a row that verified no draft
anywhere, one request keeps its whole draft: the engine-wide estimate of
every position stays current. Each probe that does not revive speculation
doubles the wait (up to 8x), so exploring where drafts never pay costs
little (a simulated engine with 5% acceptance: one request's draft every
~40 steps, `tests/test_adaptive_unit.py`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vllm_specplug.adaptive.acceptance import AcceptanceEstimator, confidence_buckets
from vllm_specplug.adaptive.cost_model import StepCostModel
from vllm_specplug.adaptive.policy import choose_draft_lengths

logger = logging.getLogger("vllm_specplug.adaptive")
LOG_INTERVAL_S = 10.0


@dataclass
class AdaptiveStats:
    """What the controller decided and how it turned out (bench, logs)."""
    num_steps: int = 0  # steps with at least one drafting request
    num_offered: int = 0  # draft tokens the proposer offered
    num_kept: int = 0  # of which verified
    num_zero: int = 0  # requests offered a draft and cut to none
    num_requests: int = 0  # drafting requests, over all steps
    expected_accepted: float = 0.0  # sum over kept tokens of their survival estimate
    num_verified_drafts: int = 0  # kept drafts whose verification was seen
    num_accepted: int = 0  # their accepted tokens
    num_probes: int = 0
    num_global_probes: int = 0  # steps where one request kept its whole draft to explore
    num_global_probe_tokens: int = 0  # the draft tokens those probes kept

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["mean_kept_per_request"] = self.num_kept / max(self.num_requests, 1)
        return out


class AdaptiveController:
    def __init__(self, max_num_draft: int, probe_interval: int = 32,
                 global_probe_interval: int | None = 8,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.max_num_draft = max_num_draft
        self.probe_interval = probe_interval
        self.global_probe_interval = global_probe_interval  # None: never explore globally
        self.global_zero_streak = 0
        self.global_wait = global_probe_interval  # doubles after each fruitless probe
        self.clock = clock
        self.acceptance = AcceptanceEstimator(max_num_draft)
        self.cost = StepCostModel()
        self.stats = AdaptiveStats()
        self.kept: dict[str, int] = {}  # req_id -> draft length verified next
        self.buckets: dict[str, np.ndarray] = {}  # req_id -> its kept tokens' confidence buckets
        self.zero_streak: dict[str, int] = {}
        self.last_step_time: float | None = None
        self.last_log_time = clock()

    def step_done(self, num_tokens: int) -> None:
        now = self.clock()
        if self.last_step_time is not None and num_tokens > 0:
            self.cost.observe(num_tokens, now - self.last_step_time)
        self.last_step_time = now
        if now - self.last_log_time > LOG_INTERVAL_S:
            self.last_log_time = now
            self._log()

    def verified(self, req_id: str, num_new: int) -> None:
        num_drafted = self.kept.pop(req_id, 0)
        buckets = self.buckets.pop(req_id, None)
        if num_drafted <= 0 or num_new <= 0:
            return
        num_accepted = min(num_new - 1, num_drafted)
        self.acceptance.observe(req_id, num_drafted, num_accepted, buckets)
        self.stats.num_verified_drafts += 1
        self.stats.num_accepted += num_accepted

    def forget(self, req_id: str) -> None:
        self.acceptance.forget(req_id)
        for table in (self.kept, self.zero_streak, self.buckets):
            table.pop(req_id, None)

    def trim(self, req_ids: list[str], drafts: list[list[int]], num_reqs: int,
             confidences: list[list[float] | None] | None = None) -> list[list[int]]:
        """`drafts` (one per drafting request, in order) cut to the chosen
        lengths; `num_reqs` counts every request of the step; `confidences`:
        the proposer's per-token confidence in [0, 1] per draft (None where
        it gives none)."""
        buckets = [None if c is None else confidence_buckets(c[:len(d)]) for c, d in
                   zip(confidences or [None] * len(drafts), drafts)]
        survival = [self.acceptance.survival(r, len(d), b)
                    for r, d, b in zip(req_ids, drafts, buckets)]
        fixed, per_token = self.cost.coefficients()
        lengths = choose_draft_lengths(survival, max(num_reqs, len(req_ids)), 0,
                                       fixed, per_token)
        lengths = [self._probe(r, n, len(d)) for r, n, d in zip(req_ids, lengths, drafts)]
        lengths = self._explore(lengths, drafts)
        kept = []
        for req_id, draft, probs, n, b in zip(req_ids, drafts, survival, lengths, buckets):
            self.kept[req_id] = n
            if b is not None:
                self.buckets[req_id] = b[:n]
            self.stats.expected_accepted += float(probs[:n].sum())
            kept.append(draft[:n])
        self._count(drafts, kept)
        return kept

    def _probe(self, req_id: str, n: int, num_offered: int) -> int:
        if n > 0 or num_offered == 0:
            self.zero_streak.pop(req_id, None)
            return n
        streak = self.zero_streak.get(req_id, 0) + 1
        if streak >= self.probe_interval:
            self.zero_streak.pop(req_id, None)
            self.stats.num_probes += 1
            return 1
        self.zero_streak[req_id] = streak
        return 0

    def _explore(self, lengths: list[int], drafts: list[list[int]]) -> list[int]:
        """After `global_probe_interval` steps in a row with no draft kept
        anywhere, the longest offered draft is kept whole."""
        if self.global_probe_interval is None:
            return lengths
        if any(lengths):  # speculating again: the next quiet spell starts afresh
            self.global_zero_streak, self.global_wait = 0, self.global_probe_interval
            return lengths
        if not any(drafts):
            return lengths
        self.global_zero_streak += 1
        if self.global_zero_streak < self.global_wait:
            return lengths
        self.global_zero_streak = 0
        self.global_wait = min(2 * self.global_wait, 8 * self.global_probe_interval)
        longest = max(range(len(drafts)), key=lambda i: len(drafts[i]))
        self.stats.num_global_probes += 1
        self.stats.num_global_probe_tokens += len(drafts[longest])
        return [len(drafts[i]) if i == longest else n for i, n in enumerate(lengths)]

    def _count(self, drafts: list[list[int]], kept: list[list[int]]) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_requests += len(drafts)
        s.num_offered += sum(len(d) for d in drafts)
        s.num_kept += sum(len(d) for d in kept)
        s.num_zero += sum(1 for d, k in zip(drafts, kept) if d and not k)

    def as_dict(self) -> dict:
        fixed, per_token = self.cost.coefficients()
        return {**self.stats.as_dict(), "cost_fixed_ms": fixed * 1e3,
                "cost_per_token_ms": per_token * 1e3, "cost_samples": self.cost.num_samples,
                "global_acceptance": np.round(self.acceptance.global_rates(), 4).tolist(),
                "confidence_acceptance": np.round(self.acceptance.confidence.rates(), 4).tolist(),
                "confidence_tokens": np.round(self.acceptance.confidence.tried, 1).tolist()}

    def _log(self) -> None:
        s = self.stats
        logger.info(
            "vllm-specplug adaptive: kept %d of %d offered draft tokens (%.2f per request, "
            "%d requests cut to none), accepted %d vs %.1f expected; step cost %.3f ms + "
            "%.4f ms/token", s.num_kept, s.num_offered, s.num_kept / max(s.num_requests, 1),
            s.num_zero, s.num_accepted, s.expected_accepted, *(
                c * 1e3 for c in self.cost.coefficients()))
