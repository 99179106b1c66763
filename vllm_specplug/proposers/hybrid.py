"""An ordered combination of proposers, chosen per request per step.

    {"method": "specplug_hybrid", "num_speculative_tokens": 8,
     "proposers": [{"method": "specplug_suffix", "min_token_prob": 0.2},
                   {"method": "specplug_ngram", "prompt_lookup_max": 4}]}

Each step every request takes the first draft with at least
`min_draft_tokens` tokens, in the configured order (e.g. suffix when it has a
confident match, n-gram otherwise). Every member sees the full lifecycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_specplug.proposers.base import (Drafts, ProposeBatch, Proposer, ProposerConfigError,
                                          ProposerContext, ProposerOptions, StopReason,
                                          require)


@dataclass(frozen=True)
class HybridOptions(ProposerOptions):
    proposers: list = field(default_factory=list)  # [{"method": name, **options}, ...]
    min_draft_tokens: int = 1

    def validate(self, name: str) -> None:
        from vllm_specplug.registry import parse_options

        require(len(self.proposers) >= 1, name,
                "proposers must list at least one {'method': ..., ...} entry")
        require(self.min_draft_tokens >= 1, name,
                f"min_draft_tokens={self.min_draft_tokens} must be >= 1")
        for index, entry in enumerate(self.proposers):
            require(isinstance(entry, dict) and isinstance(entry.get("method"), str),
                    name, f"proposers[{index}] must be a dict with a 'method' string")
            try:
                parse_options(entry["method"], _member_options(entry))
            except ProposerConfigError as exc:
                raise ProposerConfigError(f"{name}.proposers[{index}]: {exc}") from exc


def _member_options(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "method"}


class HybridProposer(Proposer):
    options_cls = HybridOptions

    def __init__(self, options: HybridOptions, context: ProposerContext) -> None:
        super().__init__(options, context)
        from vllm_specplug.registry import get_proposer_class, parse_options

        self.members: list[Proposer] = []
        for entry in options.proposers:
            member_options = parse_options(entry["method"], _member_options(entry))
            self.members.append(get_proposer_class(entry["method"])(member_options, context))
        self.uses_hidden_states = any(m.uses_hidden_states for m in self.members)
        self.reads_grammars = any(m.reads_grammars for m in self.members)

    def start_request(self, req_id: str, prompt_token_ids: np.ndarray) -> None:
        for member in self.members:
            member.start_request(req_id, prompt_token_ids)

    def update_request(self, req_id: str, new_token_ids: list[int]) -> None:
        for member in self.members:
            member.update_request(req_id, new_token_ids)

    def stop_request(self, req_id: str, reason: StopReason) -> None:
        for member in self.members:
            member.stop_request(req_id, reason)

    def propose(self, batch: ProposeBatch) -> Drafts:
        """Each request's draft from the first member whose draft is long
        enough, with that member's confidences."""
        chosen = Drafts([[] for _ in batch.req_ids], [None] * len(batch.req_ids))
        pending = list(range(len(batch.req_ids)))
        for member in self.members:
            if not pending:
                break
            proposed = member.propose(batch.rows(pending))
            if not isinstance(proposed, Drafts):
                proposed = Drafts(proposed, [None] * len(proposed))
            for i, draft, confidences in zip(list(pending), proposed.token_ids,
                                             proposed.confidences):
                if len(draft) >= self.options.min_draft_tokens:
                    chosen.token_ids[i], chosen.confidences[i] = draft, confidences
                    pending.remove(i)
        return chosen
