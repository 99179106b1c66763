"""The first drafting step's grammar masks inside the graphed pass
(`grammar_drafts: "first"` on Model Runner V2).

Under a grammar most of what masked drafts gain is the first step's: the
root's children ranked among the tokens the grammar allows after the
request's output (on SmolLM2 under a JSON schema, tree 16 made 1.34 tokens a
step so, 1.33 with every step masked, 1.22 unmasked:
docs/results/grammar_drafting_cpu). Those masks need no read of the drafting
pass: the host fills each structured request's bitmask in its root's state
(`StructuredRequests.root_bitmask`, one read of the batch's outputs), copies
it into a persistent device buffer, and the pass (fused decode step or
drafting pass, replayed from their CUDA graphs) masks its first step's logits
from that buffer (`HeadRuntime.first_logits_mask`). Free requests' rows keep
every bit set, so graphs captured with the mask serve every batch.

Selection only, like every draft mask: the scheduler still checks each node
against its path's grammar, so any mask, stale or wrong, is lossless.
"""
from __future__ import annotations

import torch

from vllm_specplug.integration.grammar_drafting import draft_bits

ALL_ALLOWED = -1  # an int32 word with every bit set


class RootMasks:
    """A graph-safe first-step mask over a persistent bitmask.

    num_rows: the padded batch's most rows; vocab_size: the target's (the
    grammar's bitmask covers it, 32 tokens a word); draft_to_target
    [V_draft] int64 on the device: each draft id's target token."""

    def __init__(self, num_rows: int, vocab_size: int, draft_to_target: torch.Tensor) -> None:
        self.draft_to_target = draft_to_target
        # [num_rows, words] int32: row b's bits are batch row b's allowed tokens
        self.bitmask = torch.full((num_rows, (vocab_size + 31) // 32), ALL_ALLOWED,
                                  dtype=torch.int32, device=draft_to_target.device)
        self.num_masked_rows = 0  # leading rows that hold a grammar's bits

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V_draft] of the first drafting step -> the same, -inf
        where a row's grammar forbids the token. A row whose grammar allows
        no draft id keeps its logits (all -inf would make the log-softmax NaN)."""
        allowed = draft_bits(self.bitmask[:logits.shape[0]], self.draft_to_target)
        allowed |= ~allowed.any(-1, keepdim=True)
        return logits.masked_fill(~allowed, float("-inf"))

    def load(self, bitmask: torch.Tensor | None) -> None:
        """The step's rows ([num_reqs, words] int32 on the host, batch order;
        None: no grammar in the batch). Rows a previous step masked past
        these are reset: a padded pass would read them."""
        num_rows = 0 if bitmask is None else bitmask.shape[0]
        if self.num_masked_rows > num_rows:
            self.bitmask[num_rows:self.num_masked_rows].fill_(ALL_ALLOWED)
        if bitmask is not None:
            words = min(bitmask.shape[1], self.bitmask.shape[1])
            self.bitmask[:num_rows, :words].copy_(bitmask[:, :words])  # host memory: done on return
        self.num_masked_rows = num_rows

    def clear(self) -> None:
        """Every row allowed (a step whose fill failed)."""
        self.load(None)
