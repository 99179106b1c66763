"""Prompt-lookup (n-gram) proposer, vectorised over the whole batch.

Take the longest n in [`prompt_lookup_min`, `prompt_lookup_max`] for which
the request's last n tokens occurred earlier, and propose the tokens that
followed an earlier occurrence (the most recent one with k tokens after it,
else the earliest). One [B, W] comparison serves
the whole batch; longer matches are grown from its few candidates. Under
Model Runner V2 the same selection runs on the device (ngram_device.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplug.proposers.base import (Drafts, ProposeBatch, Proposer, ProposerOptions,
                                          require)


@dataclass(frozen=True)
class NgramOptions(ProposerOptions):
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def validate(self, name: str) -> None:
        require(self.prompt_lookup_min >= 1, name,
                f"prompt_lookup_min={self.prompt_lookup_min} must be >= 1")
        require(self.prompt_lookup_max >= self.prompt_lookup_min, name,
                f"prompt_lookup_max={self.prompt_lookup_max} must be >= "
                f"prompt_lookup_min={self.prompt_lookup_min}")


def longest_matches(token_ids: np.ndarray, num_tokens: np.ndarray, n_min: int,
                    n_max: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the longest n in [n_min, n_max] whose last-n-token suffix also
    ends earlier at some position e <= num_tokens - 2, and which such e to
    copy from: the most recent one followed by k tokens, else the earliest
    (the longest continuation; the most recent is often right before the
    end, which leaves a short draft). Returns (n [B], e [B]), n = 0 where
    nothing matches.

    One [B, W] comparison finds every earlier occurrence of each row's last
    token; those candidates are then grown one token at a time (an occurrence
    of the last n tokens is one of the last n-1 whose token n-1 places
    earlier also agrees), so later lengths only touch the few survivors.
    """
    batch = token_ids.shape[0]
    rows = np.arange(batch)
    hit = token_ids == token_ids[rows, num_tokens - 1][:, None]
    # flatnonzero + divmod is several times faster than 2-D nonzero.
    cand_rows, cand_ends = np.divmod(np.flatnonzero(hit), token_ids.shape[1])  # by row, then end
    early = cand_ends <= num_tokens[cand_rows] - 2  # a continuation exists
    cand_rows, cand_ends = cand_rows[early], cand_ends[early]
    best_n = np.zeros(batch, dtype=np.int64)
    best_end = np.full(batch, -1, dtype=np.int64)
    kept_rows, kept_ends, kept_n = [], [], []
    for n in range(1, n_max + 1):
        if n > 1:
            back = cand_ends - (n - 1)
            keep = back >= 0
            keep[keep] = (token_ids[cand_rows[keep], back[keep]]
                          == token_ids[cand_rows[keep], num_tokens[cand_rows[keep]] - n])
            cand_rows, cand_ends = cand_rows[keep], cand_ends[keep]
        if cand_rows.size == 0:
            break
        if n >= n_min:
            best_n[cand_rows] = n
            kept_rows.append(cand_rows)
            kept_ends.append(cand_ends)
            kept_n.append(np.full(cand_rows.size, n))
    if kept_rows:
        rows_all, ends_all = np.concatenate(kept_rows), np.concatenate(kept_ends)
        at_best = np.concatenate(kept_n) == best_n[rows_all]
        # Each row's candidates now come from one level: contiguous, as needed.
        row_ids, ends = _preferred_ends(rows_all[at_best], ends_all[at_best], num_tokens, k)
        best_end[row_ids] = ends
    return best_n, best_end


def _preferred_ends(cand_rows, cand_ends, num_tokens, k):
    """Per row present in the candidates: the most recent end with a full
    k-token continuation, else the earliest end."""
    full = cand_ends <= num_tokens[cand_rows] - 1 - k
    offset = int(num_tokens.max()) + 1
    score = np.where(full, offset + cand_ends, -cand_ends)  # full ones rank first
    starts = np.flatnonzero(np.append(True, cand_rows[1:] != cand_rows[:-1]))
    best = np.maximum.reduceat(score, starts)
    return cand_rows[starts], np.where(best >= offset, best - offset, -best)


class NgramProposer(Proposer):
    options_cls = NgramOptions

    def device_drafter(self, max_num_reqs: int):
        from vllm_specplug.proposers.ngram_device import NgramDeviceDrafter

        opts: NgramOptions = self.options
        return NgramDeviceDrafter(opts.prompt_lookup_min, opts.prompt_lookup_max,
                                  max_num_reqs, self.context.max_model_len,
                                  torch.device(self.context.device))

    def propose(self, batch: ProposeBatch) -> Drafts:
        """The continuation of each request's longest matched n-gram; each
        token's confidence is the match length over `prompt_lookup_max` (a
        longer match is likelier to continue)."""
        opts: NgramOptions = self.options
        num_reqs, k = len(batch.req_ids), batch.num_spec_tokens
        drafts = Drafts([[] for _ in range(num_reqs)], [None] * num_reqs)
        if num_reqs == 0 or k == 0:
            return drafts
        width = int(batch.num_tokens.max())
        token_ids = batch.token_ids[:, :width]
        best_n, best_end = longest_matches(token_ids, batch.num_tokens,
                                           opts.prompt_lookup_min,
                                           opts.prompt_lookup_max, k)
        for row in np.flatnonzero(best_n > 0):
            begin = int(best_end[row]) + 1
            end = min(begin + k, int(batch.num_tokens[row]))
            drafts.token_ids[row] = token_ids[row, begin:end].tolist()
            confidence = min(1.0, int(best_n[row]) / opts.prompt_lookup_max)
            drafts.confidences[row] = [confidence] * (end - begin)
        return drafts
