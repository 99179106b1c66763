"""The drafter vLLM instantiates for our methods (through `custom_class`).

It turns the model runner's batch state into our proposer lifecycle calls and
`ProposeBatch`es. vLLM's own custom_class call (`propose(sampled, ...)`) has
no request ids, so `patches/gpu_model_runner.py` routes the runner to
`propose_for_runner` instead, with the runner and scheduler output in hand.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_specplug.integration.config import selection_of
from vllm_specplug.proposers.base import ProposeBatch, ProposerContext, StopReason
from vllm_specplug.registry import get_proposer_class, parse_options

logger = logging.getLogger("vllm_specplug.drafter")


class DraftLengthError(RuntimeError):
    pass


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
        context = ProposerContext(
            num_speculative_tokens=spec.num_speculative_tokens,
            max_model_len=self.max_model_len,
            vocab_size=vllm_config.model_config.get_vocab_size(),
            device=str(vllm_config.device_config.device))
        options = parse_options(selection.method, selection.options)
        self.proposer = get_proposer_class(selection.method)(options, context)
        self.active: set[str] = set()
        logger.info("vllm-specplug proposer %s with %s", self.method, options)

    def load_model(self, *args, **kwargs) -> None:
        """Model-free proposers load nothing (the CPU runner calls this)."""

    def propose(self, *args, **kwargs):
        raise RuntimeError("vllm-specplug's model-runner hook is not installed in this "
                           "worker; the plugin did not register here")

    def on_request_removed(self, req_id: str) -> None:
        """The runner dropped a finished or aborted request (called from
        `_on_request_state_removed`, also in steps that schedule nothing)."""
        if req_id in self.active:
            self.proposer.stop_request(req_id, StopReason.FINISHED)
            self.active.discard(req_id)

    def _retire(self, scheduler_output) -> None:
        """Preempted requests (they come back as new to us if they resume;
        a preemption in a step without drafting goes unnoticed, which is
        harmless: the history continues unchanged)."""
        for req_id in (scheduler_output.preempted_req_ids or set()) & self.active:
            self.proposer.stop_request(req_id, StopReason.PREEMPTED)
            self.active.discard(req_id)

    def _track(self, input_batch, sampled_token_ids: list[list[int]]) -> None:
        """Start newly seen requests with their whole history; feed others
        the tokens accepted this step."""
        for i, req_id in enumerate(input_batch.req_ids):
            if req_id in self.active:
                if sampled_token_ids[i]:
                    self.proposer.update_request(req_id, list(sampled_token_ids[i]))
                continue
            num_prompt = int(input_batch.num_prompt_tokens[i])
            num_tokens = int(input_batch.num_tokens_no_spec[i])
            row = input_batch.token_ids_cpu[i]
            self.proposer.start_request(req_id, row[:num_prompt].copy())
            if num_tokens > num_prompt:
                self.proposer.update_request(req_id, row[num_prompt:num_tokens].tolist())
            self.active.add(req_id)

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids,
                           sample_hidden_states, spec_decode_metadata) -> list[list[int]]:
        input_batch = runner.input_batch
        self._retire(scheduler_output)
        self._track(input_batch, sampled_token_ids)
        num_reqs = len(input_batch.req_ids)
        num_tokens = input_batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        k = scheduler_output.num_spec_tokens_to_schedule
        # Partial prefills sampled nothing; full-length requests cannot grow.
        rows = [i for i in range(num_reqs)
                if sampled_token_ids[i] and num_tokens[i] < self.max_model_len]
        if not rows or k <= 0:
            return drafts
        index = np.asarray(rows)
        width = int(num_tokens[index].max())
        hidden = None
        if self.proposer.uses_hidden_states:
            hidden = last_accepted_hidden(sample_hidden_states, sampled_token_ids,
                                          spec_decode_metadata)[index]
        batch = ProposeBatch([input_batch.req_ids[i] for i in rows],
                             input_batch.token_ids_cpu[index, :width], num_tokens[index],
                             k, hidden)
        for i, draft in zip(rows, self.proposer.propose(batch)):
            if len(draft) > k:
                raise DraftLengthError(f"proposer {self.method!r} returned {len(draft)} "
                                       f"draft tokens; at most {k} are allowed this step")
            drafts[i] = [int(t) for t in draft[:self.max_model_len - num_tokens[i]]]
        return drafts


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
