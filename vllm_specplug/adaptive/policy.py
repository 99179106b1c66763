"""The draft lengths that maximise expected tokens per second this step.

A step verifies each request's token plus the draft tokens kept for it.
If draft token k of request i survives verification with probability
P[i][k] (non-increasing in k: a chain stops at its first rejection), the
step yields E = num_reqs + sum of the kept P in expectation, and costs
fixed + per_token * T seconds for T verified tokens (cost_model.py).
Keeping one more draft token raises E / seconds exactly when

    P * (fixed + per_token * T) > E * per_token,

and since P only falls along the candidates taken in decreasing order
while E / seconds rises, the best set is a prefix of that order: take
candidates while the inequality holds. The same reasoning, with a fixed
batch-wide K instead of per-request lengths, is the "goodput" rule of
SmartSpec (Liu et al. 2024) and vLLM's adaptive verification.
"""
from __future__ import annotations

import numpy as np


def choose_draft_lengths(survival: list[np.ndarray], num_reqs: int, num_other_tokens: int,
                         fixed_seconds: float, seconds_per_token: float) -> list[int]:
    """How many leading draft tokens of each drafting request to verify.

    survival: per drafting request, [num_draft] float probabilities that its
    draft tokens 0..k are all accepted (non-increasing); num_reqs: requests
    in the step (each verifies at least its own token); num_other_tokens:
    tokens the step computes besides those (prefill chunks).
    """
    lengths = [0] * len(survival)
    candidates = [(-float(p), k, i) for i, probs in enumerate(survival)
                  for k, p in enumerate(probs)]
    if not candidates:
        return lengths
    candidates.sort()
    expected = float(num_reqs)
    num_tokens = float(num_reqs + num_other_tokens)
    for neg_p, k, i in candidates:
        p = -neg_p
        if k != lengths[i]:   # a tie broken out of chain order: wait for its parent
            continue
        if p * (fixed_seconds + seconds_per_token * num_tokens) <= expected * seconds_per_token:
            break
        lengths[i] += 1
        expected += p
        num_tokens += 1
    return lengths
