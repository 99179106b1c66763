"""Online acceptance estimates, per request and per draft position.

A chain draft of length d verified with `a` tokens accepted tells, for each
position k < d, whether the draft token at k was accepted given that every
token before it was: positions 0..a-1 were, position a (when a < d) was not,
and positions past a were never tried. These conditional rates are what a
draft length decision needs: the chance that the first k+1 draft tokens are
all accepted is the product of the first k+1 rates (SpecDec++, Huang et al.
2024, model the same per-position stop probability; here it is counted, not
predicted).

Each request's counts decay with its own verifications (acceptance comes in
runs: a request that copies from its prompt, then writes freely), and are
shrunk toward the engine-wide counts of the same position, which decay per
observation. A request seen for the first time starts at the engine-wide
estimate.

Where the proposer says how sure it is of each draft token (`Drafts`:
n-gram match length, suffix-tree frequencies), the engine-wide prior of a
token is also shrunk toward what tokens of its confidence bucket were
accepted (`ConfidenceCounts`): the proposer's confidence, calibrated online
against verification, tells a sure draft from a guess before the request has
any history.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

NUM_CONFIDENCE_BUCKETS = 4  # [0, .25), [.25, .5), [.5, .75), [.75, 1]


def confidence_buckets(confidences: Sequence[float]) -> np.ndarray:
    """[n] int64 bucket of each token's confidence in [0, 1]."""
    values = np.asarray(confidences, dtype=np.float64)
    return np.minimum((values * NUM_CONFIDENCE_BUCKETS).astype(np.int64),
                      NUM_CONFIDENCE_BUCKETS - 1)


@dataclass
class PositionCounts:
    """Decayed Bernoulli counts per draft position."""
    accepted: np.ndarray  # [K] float64: accepted at k, given all before accepted
    tried: np.ndarray  # [K] float64: verified at k, given all before accepted

    @classmethod
    def zeros(cls, k: int) -> "PositionCounts":
        return cls(np.zeros(k), np.zeros(k))

    def add(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        """One verification: `num_accepted` of `num_drafted` chain tokens."""
        self.accepted *= decay
        self.tried *= decay
        n = min(num_accepted + 1, num_drafted, len(self.tried))
        self.tried[:n] += 1.0
        self.accepted[:min(num_accepted, n)] += 1.0


@dataclass
class ConfidenceCounts:
    """Decayed counts, per confidence bucket, of draft tokens verified and
    accepted (each given every token before it accepted)."""
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(NUM_CONFIDENCE_BUCKETS))
    tried: np.ndarray = field(default_factory=lambda: np.zeros(NUM_CONFIDENCE_BUCKETS))

    def add(self, buckets: np.ndarray, num_accepted: int, decay: float) -> None:
        """One verification of a draft whose tokens fall in `buckets`."""
        self.accepted *= decay
        self.tried *= decay
        n = min(num_accepted + 1, len(buckets))
        np.add.at(self.tried, buckets[:n], 1.0)
        np.add.at(self.accepted, buckets[:min(num_accepted, n)], 1.0)

    def calibrated(self, buckets: np.ndarray, prior: np.ndarray, weight: float) -> np.ndarray:
        """[n] each token's bucket rate, shrunk toward `prior` [n] by `weight`
        verifications."""
        return (self.accepted[buckets] + weight * prior) / (self.tried[buckets] + weight)

    def rates(self) -> np.ndarray:
        """[buckets] acceptance per bucket (Beta(1, 1) prior)."""
        return (self.accepted + 1.0) / (self.tried + 2.0)


@dataclass
class AcceptanceEstimator:
    """Conditional acceptance rate per (request, position), and the
    cumulative probability that a draft prefix survives verification.

    `request_decay` weighs a request's own past verifications (0.7: the
    last ~3 count most), `prior_weight` is how many verifications the
    engine-wide rate is worth against a request's own, and `global_decay`
    forgets engine-wide observations (about the last 1/(1-decay))."""
    max_num_draft: int
    request_decay: float = 0.7
    prior_weight: float = 2.0
    global_decay: float = 0.995
    # verifications the position prior is worth against a confidence bucket's
    confidence_weight: float = 4.0
    # the engine-wide prior before anything was seen: Beta(1, 1) per position
    global_counts: PositionCounts = field(init=False)
    confidence: ConfidenceCounts = field(init=False, default_factory=ConfidenceCounts)
    requests: dict[str, PositionCounts] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.global_counts = PositionCounts.zeros(self.max_num_draft)

    def observe(self, req_id: str, num_drafted: int, num_accepted: int,
                buckets: np.ndarray | None = None) -> None:
        """A verified chain draft of `req_id` (`buckets`: its tokens'
        confidence buckets, when the proposer gave confidences)."""
        if num_drafted <= 0:
            return
        counts = self.requests.setdefault(req_id, PositionCounts.zeros(self.max_num_draft))
        counts.add(num_drafted, num_accepted, self.request_decay)
        self.global_counts.add(num_drafted, num_accepted, self.global_decay)
        if buckets is not None:
            self.confidence.add(buckets[:num_drafted], num_accepted, self.global_decay)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def global_rates(self) -> np.ndarray:
        """[K] engine-wide conditional acceptance per position (Beta(1,1) prior)."""
        g = self.global_counts
        return (g.accepted + 1.0) / (g.tried + 2.0)

    def rates(self, req_id: str, buckets: np.ndarray | None = None) -> np.ndarray:
        """[K] the request's conditional acceptance per position (the first
        len(buckets) positions calibrated by their tokens' confidence)."""
        prior = self.global_rates()
        if buckets is not None and len(buckets):
            n = min(len(buckets), len(prior))
            prior[:n] = self.confidence.calibrated(buckets[:n], prior[:n],
                                                   self.confidence_weight)
        counts = self.requests.get(req_id)
        if counts is None:
            return prior
        w = self.prior_weight
        return (counts.accepted + w * prior) / (counts.tried + w)

    def survival(self, req_id: str, num_draft: int,
                 buckets: np.ndarray | None = None) -> np.ndarray:
        """[num_draft] probability that draft tokens 0..k are all accepted,
        non-increasing in k."""
        return np.cumprod(self.rates(req_id, buckets)[:num_draft])
