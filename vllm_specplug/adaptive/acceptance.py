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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
    # the engine-wide prior before anything was seen: Beta(1, 1) per position
    global_counts: PositionCounts = field(init=False)
    requests: dict[str, PositionCounts] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.global_counts = PositionCounts.zeros(self.max_num_draft)

    def observe(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verified chain draft of `req_id`."""
        if num_drafted <= 0:
            return
        counts = self.requests.setdefault(req_id, PositionCounts.zeros(self.max_num_draft))
        counts.add(num_drafted, num_accepted, self.request_decay)
        self.global_counts.add(num_drafted, num_accepted, self.global_decay)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def global_rates(self) -> np.ndarray:
        """[K] engine-wide conditional acceptance per position (Beta(1,1) prior)."""
        g = self.global_counts
        return (g.accepted + 1.0) / (g.tried + 2.0)

    def rates(self, req_id: str) -> np.ndarray:
        """[K] the request's conditional acceptance per position."""
        prior = self.global_rates()
        counts = self.requests.get(req_id)
        if counts is None:
            return prior
        w = self.prior_weight
        return (counts.accepted + w * prior) / (counts.tried + w)

    def survival(self, req_id: str, num_draft: int) -> np.ndarray:
        """[num_draft] probability that draft tokens 0..k are all accepted,
        non-increasing in k."""
        return np.cumprod(self.rates(req_id)[:num_draft])
