"""Prompt-lookup (n-gram) proposer, vectorised over the whole batch.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, find the most
recent earlier occurrence of each request's last n tokens and propose the
tokens that followed it. One set of numpy operations serves all requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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


def last_match_starts(token_ids: np.ndarray, num_tokens: np.ndarray, n: int) -> np.ndarray:
    """[B] start of the most recent earlier occurrence of each row's last n
    tokens (whose continuation is inside the history), or -1."""
    batch, width = token_ids.shape
    rows = np.arange(batch)
    pattern = token_ids[rows[:, None], num_tokens[:, None] - n + np.arange(n)]
    windows = sliding_window_view(token_ids[:, :width - 1], n, axis=1)  # [B, W-n, n]
    hits = (windows == pattern[:, None, :]).all(axis=2)
    starts = np.arange(hits.shape[1])
    hits &= starts[None, :] <= (num_tokens - n - 1)[:, None]  # continuation exists
    last = hits.shape[1] - 1 - np.argmax(hits[:, ::-1], axis=1)
    return np.where(hits.any(axis=1) & (num_tokens > n), last, -1)


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
        pending = np.ones(num_reqs, dtype=bool)
        for n in range(opts.prompt_lookup_max, opts.prompt_lookup_min - 1, -1):
            rows = np.flatnonzero(pending & (batch.num_tokens > n))
            if rows.size == 0 or width <= n:
                continue
            starts = last_match_starts(token_ids[rows], batch.num_tokens[rows], n)
            for row, start in zip(rows[starts >= 0], starts[starts >= 0]):
                begin = start + n
                end = min(begin + k, int(batch.num_tokens[row]))
                drafts[row] = token_ids[row, begin:end].tolist()
                pending[row] = False
        return drafts
