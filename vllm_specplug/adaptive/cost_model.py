"""Step cost as measured: seconds a step takes against the tokens it
verifies, fitted online.

A step of a speculating engine verifies T = num_reqs + num_draft_tokens
tokens (plus any prefill). Its time is close to affine in T over the range
a step moves in: a fixed part (launches, host work, weights read once) and
a part per token (attention and matmul work that grows with T). On a GPU
the slope is near zero until the batch is compute-bound, and then steep; on
a CPU it is steep from the start. The controller only needs the local line,
so it is refitted each step by exponentially weighted least squares (old
steps fade), from the wall time between consecutive steps. The draft lengths
the controller itself varies, and requests coming and going, give the
spread in T that makes the slope observable; a ridge toward a prior line
holds the fit until they do, and keeps it defined when T does not move.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# (fixed, per_token) seconds before enough steps were measured: a step whose
# cost does not grow with its tokens, under which every draft token is kept
WARMUP_LINE = (1.0, 1e-9)

@dataclass
class StepCostModel:
    """seconds(T) = fixed + per_token * T, fitted to observed steps.

    `forgetting` (< 1) lets old steps fade (about 1/(1-forgetting) steps
    count); a sample more than `outlier_factor` times the prediction is an
    idle gap of the engine (no requests, a new request's wait), not a step.
    The prior line, from the first step, says 64 more tokens would double
    that step (`prior_slope_share`; at most all of the step is put on its
    tokens, so the line passes through it), and weighs `prior_weight`
    steps. Three outliers in a row are a new regime (the batch grew), and
    are taken."""
    forgetting: float = 0.98
    # steps measured before the fit is used; until then every draft is kept
    num_warmup: int = 8
    outlier_factor: float = 4.0
    prior_slope_share: float = 1.0 / 64
    prior_weight: float = 0.05
    # weighted sums over steps: 1, T, T^2, y, T*y (y = seconds)
    sums: np.ndarray = field(default_factory=lambda: np.zeros(5))  # [5] float64
    prior: np.ndarray | None = None  # [2] float64: fixed, per_token
    prior_scale: float = 1.0  # tokens of the first step: the ridge's unit for the slope
    # (fixed, per_token) seconds that override the fit (tests, what-if runs)
    pinned: tuple[float, float] | None = None
    num_samples: int = 0
    num_outliers: int = 0
    outlier_run: int = 0  # outliers set aside in a row

    def predict(self, num_tokens: float) -> float:
        fixed, per_token = self.coefficients()
        return fixed + per_token * num_tokens

    def coefficients(self) -> tuple[float, float]:
        """(fixed seconds >= 0, seconds per token > 0)."""
        if self.pinned is not None:
            return self.pinned
        if self.num_samples < self.num_warmup:
            return WARMUP_LINE
        fixed, per_token = self._solve()
        return max(fixed, 0.0), max(per_token, 1e-9)

    def observe(self, num_tokens: int, seconds: float) -> bool:
        """One step of `num_tokens` verified tokens that took `seconds`; False
        when it was set aside as an idle gap."""
        if seconds <= 0 or num_tokens <= 0:
            return False
        if self.prior is None:
            # the prior line passes through this step (fixed >= 0): a first
            # step of over 64 tokens (a GPU batch of 64 with trees) would
            # otherwise get a line 6x over its own time, which, kept while T
            # varied little, made every draft look dear (a projection on the
            # 8B shape then skipped 98% of steps at batch 64)
            per_token = min(seconds * self.prior_slope_share, seconds / num_tokens)
            self.prior = np.array([seconds - per_token * num_tokens, per_token])
            self.prior_scale = float(num_tokens)
        elif (self.num_samples >= 4 and self.outlier_run < 2
              and seconds > self.outlier_factor * self.predict(num_tokens)):
            self.num_outliers += 1
            self.outlier_run += 1
            return False
        self.outlier_run = 0
        t = float(num_tokens)
        self.sums = self.sums * self.forgetting + np.array([1.0, t, t * t, seconds, t * seconds])
        self.num_samples += 1
        return True

    def _solve(self) -> tuple[float, float]:
        n, st, stt, sy, sty = self.sums
        ridge_fixed = self.prior_weight
        ridge_slope = self.prior_weight * self.prior_scale ** 2
        lhs = np.array([[n + ridge_fixed, st], [st, stt + ridge_slope]])
        rhs = np.array([sy + ridge_fixed * self.prior[0], sty + ridge_slope * self.prior[1]])
        fixed, per_token = np.linalg.solve(lhs, rhs)
        return float(fixed), float(per_token)
