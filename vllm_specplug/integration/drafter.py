"""The drafter vLLM instantiates for our methods (through `custom_class`).

It turns the model runner's batch state into our proposer lifecycle calls and
`ProposeBatch`es. vLLM's own custom_class call (`propose(sampled, ...)`) has
no request ids, so `patches/gpu_model_runner.py` routes the runner to
`propose_for_runner` instead, with the runner and scheduler output in hand.
Every call into the proposer goes through a `ProposerGuard` (guard.py): a
faulty proposer costs speculation, never the engine.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_specplug.integration.config import selection_of
from vllm_specplug.integration.guard import (InvalidDraftError, ProposerGuard, check_draft,
                                             check_drafts)
from vllm_specplug.proposers.base import ProposeBatch, ProposerContext, StopReason
from vllm_specplug.registry import get_proposer_class, parse_options

logger = logging.getLogger("vllm_specplug.drafter")


class SpecplugDrafter:
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
        logger.info("vllm-specplug proposer %s with %s", self.method, options)

    @property
    def failure_counts(self) -> dict[str, int]:
        """{"<method>:<ExceptionType or invalid-draft kind>": count}."""
        return self.guard.failure_counts

    def load_model(self, *args, **kwargs) -> None:
        """Model-free proposers load nothing (the CPU runner calls this)."""

    def propose(self, *args, **kwargs):
        raise RuntimeError("vllm-specplug's model-runner hook is not installed in this "
                           "worker; the plugin did not register here")

    def on_request_removed(self, req_id: str) -> None:
        """The runner dropped a finished or aborted request (called from
        `_on_request_state_removed`, also in steps that schedule nothing)."""
        if req_id in self.active:
            self._stop(req_id, StopReason.FINISHED)

    def _stop(self, req_id: str, reason: StopReason) -> None:
        if not self.guard.disabled:
            self.guard.call("stop_request", [req_id], self.proposer.stop_request,
                            req_id, reason, effect="the request is forgotten")
        self.active.discard(req_id)
        self.quarantined.discard(req_id)

    def _lifecycle(self, name: str, req_id: str, *args) -> bool:
        """start_request/update_request; a failure quarantines the request."""
        ok, _ = self.guard.call(name, [req_id], getattr(self.proposer, name), req_id, *args,
                                effect="no drafts for it until it leaves the batch")
        if not ok:
            self.quarantined.add(req_id)
        return ok

    def _retire(self, scheduler_output) -> None:
        """Preempted requests (they come back as new to us if they resume;
        a preemption in a step without drafting goes unnoticed, which is
        harmless: the history continues unchanged)."""
        for req_id in (scheduler_output.preempted_req_ids or set()) & self.active:
            self._stop(req_id, StopReason.PREEMPTED)

    def _track(self, input_batch, sampled_token_ids: list[list[int]]) -> None:
        """Start newly seen requests with their whole history; feed others
        the tokens accepted this step."""
        for i, req_id in enumerate(input_batch.req_ids):
            if self.guard.disabled:
                return
            if req_id in self.quarantined:
                continue
            if req_id in self.active:
                if sampled_token_ids[i]:
                    self._lifecycle("update_request", req_id, list(sampled_token_ids[i]))
                continue
            num_prompt = int(input_batch.num_prompt_tokens[i])
            num_tokens = int(input_batch.num_tokens_no_spec[i])
            row = input_batch.token_ids_cpu[i]
            self.active.add(req_id)
            if (self._lifecycle("start_request", req_id, row[:num_prompt].copy())
                    and num_tokens > num_prompt):
                self._lifecycle("update_request", req_id,
                                row[num_prompt:num_tokens].tolist())

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids,
                           sample_hidden_states, spec_decode_metadata) -> list[list[int]]:
        input_batch = runner.input_batch
        num_reqs = len(input_batch.req_ids)
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        if self.guard.disabled:
            return drafts
        self._retire(scheduler_output)
        self._track(input_batch, sampled_token_ids)
        num_tokens = input_batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
        k = scheduler_output.num_spec_tokens_to_schedule
        # Partial prefills sampled nothing; full-length requests cannot grow.
        rows = [i for i in range(num_reqs)
                if sampled_token_ids[i] and num_tokens[i] < self.max_model_len
                and input_batch.req_ids[i] not in self.quarantined]
        if not rows or k <= 0 or self.guard.disabled:
            return drafts
        hidden = None
        if self.proposer.uses_hidden_states:
            hidden = last_accepted_hidden(sample_hidden_states, sampled_token_ids,
                                          spec_decode_metadata)[np.asarray(rows)]
        batch = ProposeBatch([input_batch.req_ids[i] for i in rows],
                             read_only_rows(input_batch.token_ids_cpu, rows, num_tokens),
                             read_only(num_tokens[rows]), k, hidden)
        ok, proposed = self.guard.call("propose", batch.req_ids, self.proposer.propose, batch)
        if ok:
            self._accept(batch, rows, proposed, drafts, num_tokens)
        return drafts

    def _accept(self, batch: ProposeBatch, rows: list[int], proposed, drafts,
                num_tokens: np.ndarray) -> None:
        """Validated drafts into `drafts`; invalid ones stay empty and count."""
        try:
            proposed = check_drafts(proposed, len(rows))
        except InvalidDraftError as exc:
            self.guard.record(f"propose:{exc.kind}", "propose", batch.req_ids, str(exc))
            return
        failed: dict[str, tuple[list[str], str]] = {}
        for i, req_id, draft in zip(rows, batch.req_ids, proposed):
            try:
                ids = check_draft(draft, batch.num_spec_tokens, self.vocab_size)
            except InvalidDraftError as exc:
                failed.setdefault(exc.kind, ([], str(exc)))[0].append(req_id)
                continue
            drafts[i] = ids[:self.max_model_len - int(num_tokens[i])]
        for kind, (req_ids, detail) in failed.items():  # one failure per kind per step
            self.guard.record(f"propose:{kind}", "propose", req_ids, detail)


def read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.setflags(write=False)
    return view


def read_only_rows(token_ids: np.ndarray, rows: list[int], num_tokens: np.ndarray
                   ) -> np.ndarray:
    """[len(rows), width] histories: a read-only view of the runner's buffer
    when the rows are contiguous (the usual case), else a read-only copy."""
    width = int(num_tokens[rows].max())
    first = rows[0]
    if rows[-1] - first + 1 == len(rows):
        return read_only(token_ids[first:first + len(rows), :width])
    return read_only(token_ids[rows, :width])


def last_accepted_hidden(sample_hidden_states: torch.Tensor, sampled_token_ids,
                         spec_decode_metadata) -> torch.Tensor:
    """[num_reqs, hidden]: the target's hidden state at each request's last
    accepted position (the position the next draft continues from)."""
    if spec_decode_metadata is None:
        per_req = [1] * len(sampled_token_ids)
    else:
        per_req = [n + 1 for n in spec_decode_metadata.num_draft_tokens]
    starts = np.concatenate([[0], np.cumsum(per_req)[:-1]])
    picks = [int(s) + max(len(t), 1) - 1 for s, t in zip(starts, sampled_token_ids)]
    return sample_hidden_states[torch.as_tensor(picks, device=sample_hidden_states.device)]
