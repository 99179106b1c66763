"""One proposer, its request lifecycle and its guard: what both runner
adapters share.

vLLM has two model runners: the V1 runner (`drafter.py`, the CPU platform and
CUDA when vLLM picks V1) and Model Runner V2 (`v2_speculator.py`, CUDA).
Each adapter only reads its runner's batch state; starting, updating and
stopping requests, calling `propose` and validating the drafts happen here,
once, so a proposer behaves the same under either runner. Every call into the
proposer goes through a `ProposerGuard` (guard.py): a faulty proposer costs
speculation, never the engine.
"""
from __future__ import annotations

import logging

import numpy as np

from vllm_specplug.adaptive.controller import AdaptiveController
from vllm_specplug.integration.config import BATCH_MODE, selection_of
from vllm_specplug.integration.guard import (InvalidDraftError, ProposerGuard,
                                             check_confidences, check_draft, check_drafts)
from vllm_specplug.proposers.base import Drafts, ProposeBatch, ProposerContext, StopReason
from vllm_specplug.registry import get_proposer_class, parse_options

logger = logging.getLogger("vllm_specplug.drafter")


class ProposerSession:
    """The proposer selected in `vllm_config.speculative_config`, with the
    set of requests it has been told about."""

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        selection = selection_of(spec)
        if selection is None:
            raise RuntimeError(
                "vllm-specplug drafter created without a proposer selection: the "
                "plugin must be loaded in the front-end process (is 'vllm_specplug' "
                "excluded by VLLM_PLUGINS?)")
        self.method = selection.method
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        context = ProposerContext(
            num_speculative_tokens=spec.num_speculative_tokens,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            device=str(vllm_config.device_config.device))
        options = parse_options(selection.method, selection.options)
        self.proposer = get_proposer_class(selection.method)(options, context)
        self.guard = ProposerGuard(self.method, selection.max_proposer_failures)
        self.active: set[str] = set()  # started, not yet stopped
        self.quarantined: set[str] = set()  # a lifecycle call failed: no drafts until removed
        # per-request draft lengths from live acceptance and step costs (None: off)
        self.adaptive_mode = selection.adaptive
        # "batch": the scheduler chooses one length for all (batch_schedule.py)
        self.adaptive = (AdaptiveController(spec.num_speculative_tokens)
                         if selection.adaptive not in ("off", BATCH_MODE) else None)
        logger.info("vllm-specplug proposer %s with %s (adaptive draft lengths %s)",
                    self.method, options, "on" if self.adaptive else "off")

    @property
    def failure_counts(self) -> dict[str, int]:
        """{"<method>:<ExceptionType or invalid-draft kind>": count}."""
        return self.guard.failure_counts

    @property
    def uses_hidden_states(self) -> bool:
        return self.proposer.uses_hidden_states

    def stop(self, req_id: str, reason: StopReason) -> None:
        if not self.guard.disabled:
            self.guard.call("stop_request", [req_id], self.proposer.stop_request,
                            req_id, reason, effect="the request is forgotten")
        self.active.discard(req_id)
        self.quarantined.discard(req_id)
        if self.adaptive is not None:
            self.adaptive.forget(req_id)

    def begin_step(self, num_scheduled_tokens: int) -> None:
        """The step that just ran computed `num_scheduled_tokens` tokens
        (its cost is the time since the last call)."""
        if self.adaptive is not None:
            self.adaptive.step_done(num_scheduled_tokens)

    def start(self, req_id: str, history: np.ndarray, num_prompt: int) -> None:
        """A request seen for the first time (or resuming), with its whole
        history: prompt first, then any output tokens it already has."""
        self.active.add(req_id)
        if (self._lifecycle("start_request", req_id, history[:num_prompt].copy())
                and len(history) > num_prompt):
            self._lifecycle("update_request", req_id, history[num_prompt:].tolist())

    def update(self, req_id: str, new_token_ids: list[int]) -> None:
        """A step's accepted tokens for `req_id`: its verified draft's
        accepted tokens and the bonus token."""
        if self.adaptive is not None:
            self.adaptive.verified(req_id, len(new_token_ids))
        if req_id not in self.quarantined and new_token_ids:
            self._lifecycle("update_request", req_id, new_token_ids)

    def _lifecycle(self, name: str, req_id: str, *args) -> bool:
        """start_request/update_request; a failure quarantines the request."""
        ok, _ = self.guard.call(name, [req_id], getattr(self.proposer, name), req_id, *args,
                                effect="no drafts for it until it leaves the batch")
        if not ok:
            self.quarantined.add(req_id)
        return ok

    def can_draft(self, req_id: str) -> bool:
        return not self.guard.disabled and req_id not in self.quarantined

    def draft(self, batch: ProposeBatch, num_reqs: int = 0) -> list[list[int]]:
        """Validated drafts, one per request of `batch` (empty where the
        proposer failed or returned an invalid draft), cut to the adaptive
        controller's lengths when it is on; `num_reqs` counts every request
        of the step, drafting or not."""
        drafts, confidences = self._checked_drafts(batch)
        if self.adaptive is None:
            return drafts
        return self.adaptive.trim(batch.req_ids, drafts, max(num_reqs, len(batch.req_ids)),
                                  confidences)

    def _checked_drafts(self, batch: ProposeBatch):
        """(drafts, per-draft token confidences or None)."""
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        ok, proposed = self.guard.call("propose", batch.req_ids, self.proposer.propose, batch)
        if not ok:
            return drafts, None
        proposed, confidences = self._unwrap(proposed, batch)
        try:
            proposed = check_drafts(proposed, len(batch.req_ids))
        except InvalidDraftError as exc:
            self.guard.record(f"propose:{exc.kind}", "propose", batch.req_ids, str(exc))
            return drafts, None
        failed: dict[str, tuple[list[str], str]] = {}
        for i, (req_id, draft) in enumerate(zip(batch.req_ids, proposed)):
            try:
                ids = check_draft(draft, batch.num_spec_tokens, self.vocab_size)
            except InvalidDraftError as exc:
                failed.setdefault(exc.kind, ([], str(exc)))[0].append(req_id)
                continue
            drafts[i] = ids[:self.max_model_len - int(batch.num_tokens[i])]
        for kind, (req_ids, detail) in failed.items():  # one failure per kind per step
            self.guard.record(f"propose:{kind}", "propose", req_ids, detail)
        return drafts, confidences

    def _unwrap(self, proposed, batch: ProposeBatch):
        """A `Drafts` result's drafts and checked confidences (bad ones are a
        recorded failure that costs the confidences, not the drafts)."""
        if not isinstance(proposed, Drafts):
            return proposed, None
        try:
            return list(proposed), check_confidences(proposed.confidences, proposed)
        except (InvalidDraftError, TypeError) as exc:
            self.guard.record("propose:confidences", "propose", batch.req_ids, str(exc),
                              effect="drafts kept without confidences")
            return list(proposed), None


def read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.setflags(write=False)
    return view


def read_only_rows(token_ids: np.ndarray, rows: list[int] | np.ndarray,
                   num_tokens: np.ndarray) -> np.ndarray:
    """[len(rows), width] histories (width = the longest of `num_tokens`): a
    read-only view of the runner's buffer when the rows are contiguous and
    ascending (the usual case), else a read-only copy."""
    rows = np.asarray(rows)
    width = int(num_tokens.max())
    first = int(rows[0])
    if int(rows[-1]) - first + 1 == len(rows) and bool(np.all(np.diff(rows) == 1)):
        return read_only(token_ids[first:first + len(rows), :width])
    return read_only(token_ids[rows, :width])
