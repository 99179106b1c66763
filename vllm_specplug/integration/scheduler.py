"""Scheduler hook: size speculative slots per request from its draft lengths.

vLLM's sync `Scheduler` already schedules `1 + len(draft)` tokens per request,
because the drafts reach it (`update_draft_token_ids`) before the next step is
scheduled. Its `AsyncScheduler` schedules the next step *before* the drafts
exist, so it reserves `num_spec_tokens_to_schedule` placeholder slots for every
running request; a proposer that returns fewer tokens (n-gram without a match,
suffix with a short match) leaves `-1` slots that are computed and thrown away.

`SpecplugAsyncScheduler` keeps, per request, the length of the latest draft the
worker reported and reserves that many placeholders (at most the scheduler's
K). Lengths arrive through the two paths the engine core already has
(`update_draft_token_ids`, `update_draft_token_ids_in_output`) and through
`DRAFT_LENGTHS_ATTR` on a `ModelRunnerOutput` (a `{req_id: length}` dict a
worker may attach to the step output that carries its drafts). A misprediction
stays lossless: a longer draft is truncated to the reserved slots, a shorter one
is padded with -1 and counted as invalid, not as rejected (vLLM's own path).

Select it with `scheduler_cls="vllm_specplug.integration.scheduler.
SpecplugAsyncScheduler"`; it behaves as `AsyncScheduler` for everything else.
"""
from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_specplug.integration.grammar_trees import TreeGrammarScheduler

DRAFT_LENGTHS_ATTR = "specplug_draft_lengths"
# AsyncScheduler marks a speculative slot whose draft token is not known yet
PLACEHOLDER_TOKEN_ID = -1


class SpecplugAsyncScheduler(AsyncScheduler):
    """`AsyncScheduler` whose placeholders follow each request's draft length."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # req_id -> length of the latest draft the worker made for it
        self.draft_length_hints: dict[str, int] = {}

    def record_draft_lengths(self, draft_lengths: dict[str, int]) -> None:
        for req_id, length in draft_lengths.items():
            if req_id in self.requests:
                self.draft_length_hints[req_id] = int(length)

    def _num_placeholders(self, req_id: str, num_spec_tokens: int) -> int:
        return min(self.draft_length_hints.get(req_id, num_spec_tokens),
                   num_spec_tokens)

    def schedule(self, *args, **kwargs):
        # Placeholders for step N+1 are set when step N is scheduled, but the
        # lengths of the drafts made during step N-1 only arrive (with its
        # output) just before step N+1 is scheduled: resize them here.
        for request in self.running:
            self._resize_placeholders(request)
        return super().schedule(*args, **kwargs)

    def _resize_placeholders(self, request) -> None:
        placeholders = request.spec_token_ids
        if not placeholders or placeholders[0] != PLACEHOLDER_TOKEN_ID:
            return                      # real drafts (sync path) or none
        num_slots = self._num_placeholders(request.request_id, len(placeholders))
        if num_slots != len(placeholders):
            request.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * num_slots

    def update_draft_token_ids(self, draft_token_ids) -> None:
        self.record_draft_lengths(_lengths_of(draft_token_ids))
        super().update_draft_token_ids(draft_token_ids)

    def update_draft_token_ids_in_output(self, draft_token_ids,
                                         scheduler_output) -> None:
        self.record_draft_lengths(_lengths_of(draft_token_ids))
        super().update_draft_token_ids_in_output(draft_token_ids, scheduler_output)

    def update_from_output(self, scheduler_output, model_runner_output):
        lengths = getattr(model_runner_output, DRAFT_LENGTHS_ATTR, None)
        if lengths:
            self.record_draft_lengths(lengths)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_request(self, request, *args, **kwargs):
        self.draft_length_hints.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


def _lengths_of(draft_token_ids) -> dict[str, int]:
    return {req_id: len(ids) for req_id, ids in
            zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)}


class SpecplugTreeScheduler(TreeGrammarScheduler, Scheduler):
    """vLLM's sync `Scheduler` with grammar-aware draft trees
    (integration/grammar_trees.py); our tree methods get it on the V1
    runner unless the user names a scheduler."""
