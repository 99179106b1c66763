"""Prompt-lookup (n-gram) proposer, vectorised over the whole batch.

Take the longest n in [`prompt_lookup_min`, `prompt_lookup_max`] for which
the request's last n tokens occurred earlier, and propose the tokens that
followed their most recent earlier occurrence. One [B, W] comparison per n
serves the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specplug.proposers.base import ProposeBatch, Proposer, ProposerOptions, require


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


def longest_recent_matches(token_ids: np.ndarray, num_tokens: np.ndarray, n_min: int,
                           n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the longest n in [n_min, n_max] whose last-n-token suffix also
    ends earlier at some position e <= num_tokens - 2, and the most recent
    such e. Returns (n [B], e [B]), n = 0 where nothing matches.

    Matches are grown one token at a time: an occurrence of the last n tokens
    ending at e is one of the last n-1 tokens ending at e whose token n-1
    places earlier also agrees, so each length costs one [B, W] comparison.
    """
    batch, width = token_ids.shape
    rows = np.arange(batch)
    ends = np.arange(width)
    alive = ends[None, :] <= (num_tokens - 2)[:, None]  # a continuation exists
    best_n = np.zeros(batch, dtype=np.int64)
    best_end = np.full(batch, -1, dtype=np.int64)
    for n in range(1, n_max + 1):
        usable = num_tokens > n  # n suffix tokens plus at least one before them
        target = token_ids[rows, np.maximum(num_tokens - n, 0)]
        agree = np.zeros_like(alive)
        agree[:, n - 1:] = token_ids[:, :width - n + 1] == target[:, None]
        alive &= agree & usable[:, None]
        found = alive.any(axis=1)
        if n >= n_min and found.any():
            last = width - 1 - np.argmax(alive[:, ::-1], axis=1)
            best_n = np.where(found, n, best_n)
            best_end = np.where(found, last, best_end)
        if not found.any():
            break
    return best_n, best_end


class NgramProposer(Proposer):
    options_cls = NgramOptions

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        opts: NgramOptions = self.options
        num_reqs, k = len(batch.req_ids), batch.num_spec_tokens
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        if num_reqs == 0 or k == 0:
            return drafts
        width = int(batch.num_tokens.max())
        token_ids = batch.token_ids[:, :width]
        best_n, best_end = longest_recent_matches(token_ids, batch.num_tokens,
                                                  opts.prompt_lookup_min,
                                                  opts.prompt_lookup_max)
        for row in np.flatnonzero(best_n > 0):
            begin = int(best_end[row]) + 1
            end = min(begin + k, int(batch.num_tokens[row]))
            drafts[row] = token_ids[row, begin:end].tolist()
        return drafts
