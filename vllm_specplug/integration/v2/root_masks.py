"""The first drafting step's grammar masks inside the graphed pass
(`grammar_drafts: "first"` on Model Runner V2).

Under a grammar most of what masked drafts gain is the first step's: the
root's children ranked among the tokens the grammar allows after the
request's output (on SmolLM2 under a JSON schema, tree 16 made 1.34 tokens a
step so, 1.33 with every step masked, 1.22 unmasked:
docs/results/grammar_drafting_cpu). Those masks need no read of the drafting
pass: the host fills each structured request's bitmask in its root's state
(`StructuredRequests.root_bitmask`, one read of the batch's outputs), unpacks
it into a persistent device buffer of allowed draft ids, and the pass (fused decode step or
drafting pass, replayed from their CUDA graphs) masks its first step's logits
from that buffer (`HeadRuntime.first_logits_mask`). Free requests' rows allow
every draft id, so graphs captured with the mask serve every batch, at one
elementwise kernel a pass.

Selection only, like every draft mask: the scheduler still checks each node
against its path's grammar, so any mask, stale or wrong, is lossless.
"""
from __future__ import annotations

import torch

from vllm_specplug.integration.grammar_drafting import draft_bits
from vllm_specplug.proposers.head_graphs import padded_batch

ALL_ALLOWED = -1  # an int32 word with every bit set


class RootMasks:
    """A graph-safe first-step mask over a persistent buffer of allowed
    draft ids: one kernel inside the graphs (free rows allow every id), the
    bitmask's unpacking done at `load`, outside them, for batches with a
    grammar only.

    num_rows: the padded batch's most rows; vocab_size: the target's (the
    grammar's bitmask covers it, 32 tokens a word); draft_to_target
    [V_draft] int64 on the device: each draft id's target token."""

    def __init__(self, num_rows: int, vocab_size: int, draft_to_target: torch.Tensor) -> None:
        self.draft_to_target = draft_to_target
        self.num_words = (vocab_size + 31) // 32
        # [num_rows, V_draft] bool: row b's draft ids the grammar allows (a
        # byte an id: 8 MB at 256 rows of a 32k draft vocabulary, 131 MB at
        # 1024 rows of a full 128k one; the bitmask would be 1/8 of it but
        # cost about six kernels a pass to unpack in the graphs)
        self.allowed = torch.ones(num_rows, draft_to_target.shape[0], dtype=torch.bool,
                                  device=draft_to_target.device)
        self.num_masked_rows = 0  # leading rows that hold a grammar's bits (padding too)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V_draft] of the first drafting step -> the same, -inf
        where a row's grammar forbids the token."""
        return torch.where(self.allowed[:logits.shape[0]], logits, float("-inf"))

    def load(self, bitmask: torch.Tensor | None) -> None:
        """The step's rows ([num_reqs, words] int32 on the host, batch order,
        ALL_ALLOWED words for free requests; None: no grammar in the batch).
        A row whose grammar allows no draft id allows them all (all -inf
        would make the log-softmax NaN). The rows a pass padded to a capture
        size adds repeat the last request (`padded_batch`), slot included:
        they copy its row, so that they draft its tree again and write its
        head's cache rows as it does. Allowing everything there had them
        draft another tree into the same slot, and the fused step stored
        both (`TreeSlots.store`, repeated slots): on CUDA the kept parents,
        depths and ancestor bits could come from different trees (an output
        of the H100's wide tree under a JSON schema differed from no
        speculation's at a 1.75-nat gap, 2026-12-06). The padding's trees
        now go to a spare slot (`StepInputs.stored_slots`). Rows a previous
        step masked past these are reset: a padded pass would read them."""
        num_rows = 0 if bitmask is None else bitmask.shape[0]
        num_padded = min(padded_batch(num_rows), self.allowed.shape[0]) if num_rows else 0
        if self.num_masked_rows > num_padded:
            self.allowed[num_padded:self.num_masked_rows] = True
        if bitmask is not None:
            words = torch.full((num_rows, self.num_words), ALL_ALLOWED, dtype=torch.int32)
            num_words = min(bitmask.shape[1], self.num_words)
            words[:, :num_words] = bitmask[:, :num_words]
            allowed = draft_bits(words.to(self.allowed.device), self.draft_to_target)
            self.allowed[:num_rows] = allowed | ~allowed.any(-1, keepdim=True)
            self.allowed[num_rows:num_padded] = self.allowed[num_rows - 1]
        self.num_masked_rows = num_padded

    def clear(self) -> None:
        """Every row allowed (a step whose fill failed)."""
        self.load(None)
