"""Draft confidences for vLLM's adaptive verification (Model Runner V2, chains).

With `enable_adaptive_verification` in the speculative config, vLLM's
manager (`v1/worker/gpu/spec_decode/adaptive_verification.py`) admits each
step's best draft slots under the cost curve it measured at capture, ranked
by survival products of per-position confidences that the speculator leaves
in `draft_token_confidence_probs` [rows, K] (batch order). Our EAGLE-3 and
MTP chains fill them with vLLM's own estimator (`OnlineAcceptanceEstimator`:
a logistic fit of acceptance on the top-1 log-odds of each draft
distribution, refitted online), as vLLM's `eagle3` does:

- `predict`, inside our graphed drafting pass, on each draft step's logits
  (`HeadRuntime.draft_logits_hook`);
- `observe`, before each step's drafting, on the last drafts' verdicts.

Trees are not ranked this way (their nodes are not chain positions); the
front end refuses them (`integration/config.check_adaptive_verification`).
"""
from __future__ import annotations

import torch
from vllm.v1.worker.gpu.spec_decode.acceptance_estimator import OnlineAcceptanceEstimator


class DraftConfidences:
    def __init__(self, max_num_reqs: int, num_steps: int, num_rows: int,
                 device: torch.device) -> None:
        """`num_rows` >= max_num_reqs: a padded pass's last rows write there."""
        self.num_steps = num_steps
        self.estimator = OnlineAcceptanceEstimator(max_num_reqs, num_steps, device)
        # [rows, K] float32: read by vLLM's manager, rows in batch order
        self.confidence_probs = torch.ones(num_rows, num_steps, dtype=torch.float32,
                                           device=device)
        self.draft_steps = torch.arange(num_steps, device=device)  # [K] (graph-stable views)
        # [S] float32: the requests' sampling temperature, by state slot
        self.temperature = torch.zeros(max_num_reqs, dtype=torch.float32, device=device)

    def predict(self, logits: torch.Tensor, slots: torch.Tensor, draft_step: int) -> None:
        """Draft step `draft_step`'s logits [B, V_draft] of state `slots` [B]
        become its acceptance estimate, in row b of the confidences (steps
        past K, which nothing verifies, are skipped)."""
        if draft_step < self.num_steps:
            self.estimator.predict(logits, slots, self.draft_steps[draft_step],
                                   self.confidence_probs, self.temperature)

    def observe(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                num_rejected: torch.Tensor, temperature: torch.Tensor) -> None:
        """The last drafts' verdicts ([num_reqs] each) refine the estimator;
        `temperature` [S] is this step's, for the next predictions."""
        self.temperature.copy_(temperature)
        self.estimator.step(idx_mapping, num_sampled, num_rejected)
