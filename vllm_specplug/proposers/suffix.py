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
    # under structured outputs, a draft the grammar cuts is replaced by the
    # likeliest path of arctic's speculation tree that the grammar allows
    grammar_drafts: bool = True

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
        self.reads_grammars = options.grammar_drafts

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
            draft = self._speculate(req_id, context, batch.num_spec_tokens, tree=False)
            token_ids, probs = list(draft.token_ids), list(draft.probs)
            allowed = batch.valid_prefix.get(i) if opts.grammar_drafts else None
            num_allowed = len(token_ids) if allowed is None else allowed(token_ids)
            if num_allowed < len(token_ids):
                tree = self._speculate(req_id, context, batch.num_spec_tokens, tree=True)
                path = allowed_path(tree, allowed, batch.num_spec_tokens)
                # the longer of the chain's allowed prefix and the tree's allowed path
                token_ids, probs = (path if len(path[0]) > num_allowed else
                                    (token_ids[:num_allowed], probs[:num_allowed]))
            drafts.token_ids.append(token_ids)
            drafts.confidences.append(_conditional(probs))
        return drafts

    def _speculate(self, req_id: str, context: np.ndarray, num_spec_tokens: int, tree: bool):
        """arctic's chain, or its speculation tree (grown best-first, so its
        likeliest paths come first) of GRAMMAR_TREE_WIDTH times the nodes, so
        that it reaches about as deep as the chain."""
        opts: SuffixOptions = self.options
        width = GRAMMAR_TREE_WIDTH if tree else 1
        return self.cache.speculate(
            req_id, context,
            max_spec_tokens=width * num_spec_tokens,  # None hits an arctic bug
            max_spec_factor=width * opts.max_spec_factor,
            max_spec_offset=width * opts.max_spec_offset,
            min_token_prob=opts.min_token_prob, use_tree_spec=tree)


GRAMMAR_TREE_WIDTH = 4  # see SuffixProposer._speculate


def allowed_path(tree, allowed, max_tokens: int) -> tuple[list[int], list[float]]:
    """From the root of arctic's speculation `tree` (token_ids, parents with
    -1 for the root's children, cumulative path probs), each step the
    likeliest child whose path `allowed` accepts whole (`allowed(path)`: how
    many leading tokens the grammar allows): (token ids, their path probs),
    at most `max_tokens`."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents):
        children.setdefault(int(parent), []).append(node)
    path: list[int] = []
    probs: list[float] = []
    node = -1
    while len(path) < max_tokens:
        ranked = sorted(children.get(node, ()), key=lambda c: -tree.probs[c])
        node = next((c for c in ranked if allowed(path + [int(tree.token_ids[c])]) > len(path)),
                    None)
        if node is None:
            break
        path.append(int(tree.token_ids[node]))
        probs.append(float(tree.probs[node]))
    return path, probs


def _conditional(path_probs) -> list[float]:
    """Per-token probabilities given the tokens before, from arctic's
    cumulative path probabilities (probs[k] = P(tokens 0..k))."""
    conditional, previous = [], 1.0
    for prob in path_probs:
        conditional.append(min(1.0, max(0.0, prob / previous)) if previous > 0 else 0.0)
        previous = prob
    return conditional
