"""Suffix decoding (Oliaro et al., arXiv 2411.04975) on arctic-inference's
suffix-tree cache.

Each request gets a prompt tree; finished requests stay in a global tree
(bounded by `max_cached_requests`) so later requests benefit from earlier
responses, which is where suffix decoding shines (agentic, repetitive work).
The number of speculated tokens adapts to the match length
(`max_spec_factor`, `max_spec_offset`) and stops at tokens whose estimated
probability is below `min_token_prob`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specplug.proposers.base import (Drafts, ProposeBatch, Proposer, ProposerContext,
                                          ProposerOptions, StopReason, require)


@dataclass(frozen=True)
class SuffixOptions(ProposerOptions):
    max_tree_depth: int = 24
    max_cached_requests: int = 10000  # global cache size; 0 disables it
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1

    def validate(self, name: str) -> None:
        require(self.max_tree_depth >= 1, name,
                f"max_tree_depth={self.max_tree_depth} must be >= 1")
        require(self.max_cached_requests >= 0, name,
                f"max_cached_requests={self.max_cached_requests} must be >= 0")
        require(self.max_spec_factor > 0, name,
                f"max_spec_factor={self.max_spec_factor} must be > 0")
        require(0.0 <= self.min_token_prob <= 1.0, name,
                f"min_token_prob={self.min_token_prob} must be in [0, 1]")


class SuffixProposer(Proposer):
    options_cls = SuffixOptions

    def __init__(self, options: SuffixOptions, context: ProposerContext) -> None:
        super().__init__(options, context)
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=options.max_tree_depth,
                                         max_cached_requests=options.max_cached_requests)

    def start_request(self, req_id: str, prompt_token_ids: np.ndarray) -> None:
        if req_id in self.cache.cached_requests:  # a resumed or reused id
            self.cache.evict_cached_response(req_id)
        self.cache.start_request(req_id, np.ascontiguousarray(prompt_token_ids, dtype=np.int32))

    def update_request(self, req_id: str, new_token_ids: list[int]) -> None:
        if new_token_ids:
            self.cache.add_active_response(req_id, new_token_ids)

    def stop_request(self, req_id: str, reason: StopReason) -> None:
        if req_id in self.cache.active_requests:
            # Moves the response into the global tree for later requests.
            self.cache.stop_request(req_id)

    def propose(self, batch: ProposeBatch) -> Drafts:
        """Each request's suffix-tree speculation; a token's confidence is
        arctic's estimate of its path probability over its parent's (the
        suffix tree's frequency of the token after the path before it)."""
        opts: SuffixOptions = self.options
        drafts = Drafts([], [])
        for i, req_id in enumerate(batch.req_ids):
            # arctic wants a contiguous, writable int32 array (the history is read-only)
            context = np.array(batch.history(i)[-opts.max_tree_depth:], dtype=np.int32)
            draft = self.cache.speculate(
                req_id, context,
                max_spec_tokens=batch.num_spec_tokens,  # None hits an arctic bug
                max_spec_factor=opts.max_spec_factor,
                max_spec_offset=opts.max_spec_offset,
                min_token_prob=opts.min_token_prob, use_tree_spec=False)
            drafts.token_ids.append(list(draft.token_ids))
            drafts.confidences.append(_conditional(draft.probs))
        return drafts


def _conditional(path_probs) -> list[float]:
    """Per-token probabilities given the tokens before, from arctic's
    cumulative path probabilities (probs[k] = P(tokens 0..k))."""
    conditional, previous = [], 1.0
    for prob in path_probs:
        conditional.append(min(1.0, max(0.0, prob / previous)) if previous > 0 else 0.0)
        previous = prob
    return conditional
