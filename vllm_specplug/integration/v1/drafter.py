"""The drafter vLLM's V1 model runner instantiates for our methods (through
`custom_class`).

It reads the V1 runner's batch state (`input_batch`) and hands it to the
shared `ProposerSession` (session.py): lifecycle, guard and draft checks live
there, shared with the Model Runner V2 adapter (`v2_speculator.py`). vLLM's
own custom_class call (`propose(sampled, ...)`) has no request ids, so
`patches/gpu_model_runner.py` routes the runner to `propose_for_runner`
instead, with the runner and scheduler output in hand.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.integration.grammar_drafting import DraftGrammars, prefix_check
from vllm_specplug.integration.session import ProposerSession, read_only, read_only_rows
from vllm_specplug.integration.v1.hooks import V1DrafterHooks
from vllm_specplug.proposers.base import ProposeBatch, StopReason


class SpecplugDrafter(ProposerSession, V1DrafterHooks):
    # At tensor parallelism the first rank drafts once for all: the others
    # would repeat its work, and their adaptive controllers, timing their own
    # steps, would cut differently (patches/gpu_model_runner.py).
    drafts_on_every_rank = False
    # Model-free drafters read a step's verification metadata only for the
    # accepted tokens' hidden states, which plain sampling gives as well
    # (`last_accepted_hidden`): a step without drafts (the batch policy's
    # K = 0, or no request found one) samples as without speculation.
    plain_steps_without_drafts = True

    def __init__(self, vllm_config) -> None:
        super().__init__(vllm_config)
        # the drafter's own grammar per structured request, so a proposer with
        # other candidates can offer what the grammar allows (grammar_drafting.py)
        self.grammars = DraftGrammars(vllm_config)

    def no_drafts(self, runner) -> list[list[int]]:
        runner._draft_probs = None
        runner._draft_prob_req_ids = None
        return [[] for _ in runner.input_batch.req_ids]

    def load_model(self, *args, **kwargs) -> None:
        """Model-free proposers load nothing (the CPU runner calls this)."""

    def on_request_removed(self, req_id: str) -> None:
        """The runner dropped a finished or aborted request (called from
        `_on_request_state_removed`, also in steps that schedule nothing)."""
        if req_id in self.active:
            self.stop(req_id, StopReason.FINISHED)
        self.grammars.forget(req_id)

    def _retire(self, scheduler_output) -> None:
        """Preempted requests (they come back as new to us if they resume;
        a preemption in a step without drafting goes unnoticed, which is
        harmless: the history continues unchanged)."""
        for req_id in (scheduler_output.preempted_req_ids or set()) & self.active:
            self.stop(req_id, StopReason.PREEMPTED)

    def _track(self, input_batch, sampled_token_ids: list[list[int]]) -> None:
        """Start newly seen requests with their whole history; feed others
        the tokens accepted this step."""
        for i, req_id in enumerate(input_batch.req_ids):
            if self.guard.disabled:
                return
            if req_id in self.active:
                self.update(req_id, list(sampled_token_ids[i]))
                continue
            num_tokens = int(input_batch.num_tokens_no_spec[i])
            self.start(req_id, input_batch.token_ids_cpu[i, :num_tokens],
                       int(input_batch.num_prompt_tokens[i]))

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids,
                           outputs: dict) -> list[list[int]]:
        drafts = self.no_drafts(runner)  # drafts without probabilities
        input_batch = runner.input_batch
        num_reqs = len(input_batch.req_ids)
        if self.guard.disabled:
            return drafts
        self.begin_step(int(scheduler_output.total_num_scheduled_tokens))
        self._retire(scheduler_output)
        self._track(input_batch, sampled_token_ids)
        num_tokens = input_batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
        k = scheduler_output.num_spec_tokens_to_schedule
        # Partial prefills sampled nothing; full-length requests cannot grow.
        rows = [i for i in range(num_reqs)
                if sampled_token_ids[i] and num_tokens[i] < self.max_model_len
                and self.can_draft(input_batch.req_ids[i])]
        if not rows or k <= 0:
            return drafts
        hidden = None
        if self.uses_hidden_states:
            hidden = last_accepted_hidden(outputs["sample_hidden_states"], sampled_token_ids,
                                          outputs["spec_decode_metadata"])[np.asarray(rows)]
        batch = ProposeBatch([input_batch.req_ids[i] for i in rows],
                             read_only_rows(input_batch.token_ids_cpu, rows, num_tokens[rows]),
                             read_only(num_tokens[rows]), k, hidden,
                             self._valid_prefixes(runner, rows))
        for i, draft in zip(rows, self.draft(batch, num_reqs)):
            drafts[i] = draft
        return drafts

    def _valid_prefixes(self, runner, rows: list[int]) -> dict:
        """{batch row: how many leading tokens of a draft the request's
        grammar allows} for the rows with structured output (ProposeBatch),
        for a proposer that reads them."""
        if not self.proposer.reads_grammars:
            return {}
        checks = {}
        for j, row in enumerate(rows):
            grammar = self.grammars.of_row(runner, row)
            if grammar is not None:
                checks[j] = prefix_check(grammar)
        return checks


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
