"""Structured-output requests as Model Runner V2's speculators see them.

Model Runner V2 keeps no request's sampling params, so the grammar of a
request is out of a speculator's reach: `StructuredRequests` keeps the
structured requests' params from their first scheduler output until they
finish (a preempted request keeps its grammar, advanced as far as its
output, which it keeps), and the drafter's own grammar of each
(grammar_drafting.DraftGrammars, compiled by vLLM's manager in the worker).
The host proposers read it as draft checks (speculator.py), the heads as
masks of each drafting step (head_speculator.py).
"""
from __future__ import annotations

import numpy as np

from vllm_specplug.integration.grammar_drafting import DraftGrammars, is_constrained


class StructuredRequests:
    def __init__(self, vllm_config) -> None:
        self.grammars = DraftGrammars(vllm_config)
        self.params: dict[str, object] = {}  # req_id -> sampling params

    def __bool__(self) -> bool:
        return bool(self.params)

    def schedule(self, scheduler_output) -> None:
        """Keep the new structured requests' params; drop the finished."""
        for new in scheduler_output.scheduled_new_reqs:
            if is_constrained(new.sampling_params):
                self.params[new.req_id] = new.sampling_params
        for req_id in scheduler_output.finished_req_ids:
            if self.params.pop(req_id, None) is not None:
                self.grammars.forget(req_id)

    def grammar(self, req_id: str, output_token_ids: np.ndarray):
        """The request's grammar advanced to `output_token_ids` (its output
        so far, the last sampled token last); None: unconstrained, still
        compiling, or broken (`DraftGrammars.grammar_of`)."""
        params = self.params.get(req_id)
        if params is None:
            return None
        return self.grammars.grammar_of(req_id, params, output_token_ids)

    def path_masks(self, input_batch, req_states, layer, device):
        """A drafting pass's logits hook over the batch's requests
        (`DraftGrammars.masks`: each node's logits masked to what its path
        allows; `layer`: the head's draft layer, on `device`), each grammar
        advanced to the request's output; None when no request of the batch
        has one. Reads those requests' output from the device after the
        step's sampling: a sync, which only batches with structured output
        pay."""
        num_reqs = input_batch.num_reqs
        req_ids = list(input_batch.req_ids[:num_reqs])
        if not any(req_id in self.params for req_id in req_ids):
            return None
        slots = input_batch.idx_mapping_np[:num_reqs]
        ends = req_states.total_len.gpu[input_batch.idx_mapping[:num_reqs]].cpu().numpy()
        grammars = []
        for req_id, slot, end in zip(req_ids, slots, ends):
            start = int(req_states.prompt_len.np[slot])
            if req_id not in self.params or end <= start:  # free, or before its first token
                grammars.append(None)
                continue
            output = req_states.all_token_ids.gpu[slot, start:int(end)].cpu().numpy()
            grammars.append(self.grammar(req_id, output))
        return self.grammars.masks(req_ids, grammars, layer, device)
