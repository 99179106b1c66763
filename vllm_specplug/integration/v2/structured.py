"""Structured-output requests as Model Runner V2's speculators see them.

Model Runner V2 keeps no request's sampling params, so the grammar of a
request is out of a speculator's reach: `StructuredRequests` keeps the
structured requests' params from their first scheduler output until they
finish (a preempted request keeps its grammar, advanced as far as its
output, which it keeps), and the drafter's own grammar of each
(grammar_drafting.DraftGrammars, compiled by vLLM's manager in the worker).
The host proposers read it as draft checks (speculator.py), the heads as
masks of each drafting step (head_speculator.py) or of the first one only
(root_masks.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplug.integration.grammar_drafting import DraftGrammars, is_constrained
from vllm_specplug.integration.v2.grammar_parents import to_host_async


class StructuredRequests:
    def __init__(self, vllm_config) -> None:
        self.grammars = DraftGrammars(vllm_config)
        self.params: dict[str, object] = {}  # req_id -> sampling params
        # (step, req_ids): the requests whose grammars the last read of the
        # batch's outputs advanced, and in which drafting step (`begin_step`)
        self.step = 0
        self.last_read: tuple[int, frozenset[str]] = (-1, frozenset())
        self.queued: QueuedOutputs | None = None  # the last `queue_outputs`
        self.num_device_reads = 0  # requests `verifying_grammars` read from the device
        self.copy_stream = None  # `queue_outputs`'s, made at its first copy on CUDA

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

    def begin_step(self) -> None:
        """A drafting step starts (the grammars read before it are its
        verified step's, `verifying_grammars`)."""
        self.step += 1

    def verifying_grammars(self, req_ids: list[str], input_batch,
                           req_states) -> dict[str, object]:
        """{req_id: grammar} for a step's verification rows (worker_rows.py),
        each advanced to its request's output before this step: the
        drafting pass's read of the last step left them so, unless a request
        was not in it, or its grammar was still compiling; those are read
        from the device here (a wait for this step's forward), unless the
        drafting pass queued their copy (`queue_outputs`). A request
        without a usable grammar (broken) is left out."""
        step, fresh = self.last_read
        fresh = fresh if step == self.step else frozenset()
        stale = [req_id for req_id in req_ids if req_id not in fresh]
        outputs = self._queued_outputs(stale)
        unread = [req_id for req_id in stale if req_id not in outputs]
        if unread:
            row_of = {req_id: b for b, req_id in
                      enumerate(input_batch.req_ids[:input_batch.num_reqs])}
            rows = [row_of[req_id] for req_id in unread]
            slots = input_batch.idx_mapping_np[:input_batch.num_reqs][rows]
            outputs.update(zip(unread, self._outputs(req_states, slots)))
            self.num_device_reads += len(unread)
        found = {}
        for req_id in req_ids:
            if req_id not in self.params or (req_id in outputs and outputs[req_id] is None):
                continue  # unconstrained, or no output yet
            grammar = self.grammars.verifying_grammar(req_id, self.params[req_id],
                                                      outputs.get(req_id))
            if grammar is not None:
                found[req_id] = grammar
        return found

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
        has one."""
        found = self._grammars(input_batch, req_states)
        return None if found is None else self.grammars.masks(*found, layer, device)

    def queue_outputs(self, input_batch, req_states) -> None:
        """The drafting pass's part when it masks nothing and the worker
        fills the next step's rows: the batch's outputs copied to the host
        behind this step's sampling, not waited for; `verifying_grammars`
        reads them after the next forward is queued. (A read of them here,
        as the first step's masks make, holds the host until the GPU has
        finished the step: on SmolLM2 under a JSON schema, H200, our
        drafting host time was 2.0-3.2 ms a step with those masks against
        0.9 without: docs/results/v2_worker_rows_h200_run2.)"""
        num_reqs = input_batch.num_reqs
        req_ids = list(input_batch.req_ids[:num_reqs])
        if not any(req_id in self.params for req_id in req_ids):
            self.queued = None
            return
        slots = input_batch.idx_mapping_np[:num_reqs]
        all_token_ids = req_states.all_token_ids.gpu
        # no output ends past the positions the step computed, plus its sample
        width = int(min(all_token_ids.shape[1],
                        input_batch.seq_lens_cpu_upper_bound[:num_reqs].max() + 1))
        index = input_batch.idx_mapping[:num_reqs]
        # gathered on the step's stream: later steps write these tensors
        ends, tokens = req_states.total_len.gpu[index], all_token_ids[index, :width]
        self.queued = QueuedOutputs(self.step, req_ids, req_states.prompt_len.np[slots].copy(),
                                    width, *to_host_async(self._copy_stream(ends), ends, tokens))

    def _copy_stream(self, tensor: torch.Tensor):
        """A side stream for `queue_outputs`'s copies (as vLLM's
        DraftTokensHandler has one); None off CUDA."""
        if tensor.is_cuda and self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(tensor.device)
        return self.copy_stream

    def _queued_outputs(self, req_ids: list[str]) -> dict[str, np.ndarray | None]:
        """The outputs this drafting step queued for `req_ids` (those it has)."""
        queued = self.queued
        if queued is None or queued.step != self.step or not req_ids:
            return {}
        found = queued.outputs()
        return {req_id: found[req_id] for req_id in req_ids if req_id in found}

    def root_bitmask(self, input_batch, req_states,
                     known: dict[str, list[int]] | None = None) -> torch.Tensor | None:
        """[num_reqs, words] int32 on the host: each structured request's
        bitmask in its root's state (its output so far), all bits set for
        the others (the first drafting step's masks, root_masks.py); None
        when no request of the batch has a grammar to draft under. `known`:
        {req_id: the tokens its last step emitted}, where the host decided
        them (grammar_choices.py): those requests' outputs are not read."""
        found = self._grammars(input_batch, req_states, known)
        if found is None or all(grammar is None for grammar in found[1]):
            return None
        bitmask = self.grammars.manager.backend.allocate_token_bitmask(len(found[1]))
        for row, grammar in enumerate(found[1]):
            if grammar is not None:
                grammar.fill_bitmask(bitmask, row)
        self.grammars.num_masked_passes += 1
        return bitmask

    def _grammars(self, input_batch, req_states,
                  known: dict[str, list[int]] | None = None) -> tuple[list[str], list] | None:
        """(req_ids, grammars) of the batch (None where a request has none),
        each grammar advanced to its request's output; None when no request
        is structured. Reads those requests' output from the device after
        the step's sampling: a sync, which only batches with structured
        output pay, unless every one is `known` (`_advance_known`)."""
        num_reqs = input_batch.num_reqs
        req_ids = list(input_batch.req_ids[:num_reqs])
        rows = [b for b, req_id in enumerate(req_ids) if req_id in self.params]
        if not rows:
            return None
        grammars = [None] * num_reqs
        if known:
            rows = self._advance_known(input_batch, req_states, rows, known, grammars)
        slots = input_batch.idx_mapping_np[:num_reqs][rows]
        outputs = self._outputs(req_states, slots) if rows else []
        for b, output in zip(rows, outputs):
            if output is not None:  # None: before the request's first token
                grammars[b] = self.grammar(req_ids[b], output)
        self.last_read = (self.step, frozenset(
            req_ids[b] for b, output in zip(rows, outputs) if output is not None
            and self._advanced_to(req_ids[b], len(output))))
        return req_ids, grammars

    def _advance_known(self, input_batch, req_states, rows: list[int],
                       known: dict[str, list[int]], grammars: list) -> list[int]:
        """The grammars of the batch's `rows` whose last tokens are `known`,
        advanced by them (`DraftGrammars.advance_known`) into `grammars`;
        returns the rows left to read. Those requests' outputs are queued
        to the host without a wait (`queue_outputs`): the next step's
        `verifying_grammars` checks the tokens against them."""
        req_ids, left = input_batch.req_ids, []
        for b in rows:
            req_id = req_ids[b]
            tokens = known.get(req_id)
            if tokens is None or not self.grammars.advance_known(req_id, self.params[req_id],
                                                                 tokens):
                left.append(b)
                continue
            grammar = self.grammars.tracked[req_id].holder.structured_output_request.grammar
            grammars[b] = None if grammar.is_terminated() else grammar
        if len(left) < len(rows):
            self.queue_outputs(input_batch, req_states)
        return left

    def keep_walked(self, req_id: str, token_ids: list[int], num_advances: int) -> bool:
        """A greedy walk's advances of the request's grammar by the tokens
        its step emits, kept for the drafting pass (`DraftGrammars.keep_known`)."""
        params = self.params.get(req_id)
        return params is not None and self.grammars.keep_known(req_id, params, token_ids,
                                                               num_advances)

    def _advanced_to(self, req_id: str, num_tokens: int) -> bool:
        tracked = self.grammars.tracked.get(req_id)
        return (tracked is not None and not tracked.broken
                and tracked.num_accepted == num_tokens)

    @staticmethod
    def _outputs(req_states, slots: np.ndarray) -> list[np.ndarray | None]:
        """Each slot's output so far, read from the device in one copy (a
        sync per request made a batch of 64 wait 64 times)."""
        index = torch.from_numpy(slots).to(req_states.all_token_ids.gpu.device)
        ends = req_states.total_len.gpu[index].cpu().numpy()
        starts = req_states.prompt_len.np[slots]
        width = int(ends.max())
        tokens = req_states.all_token_ids.gpu[index, :width].cpu().numpy()
        return [tokens[i, start:end] if end > start else None
                for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist()))]


@dataclass
class QueuedOutputs:
    """A drafting step's batch outputs on their way to the host
    (`StructuredRequests.queue_outputs`)."""
    step: int                # the drafting step (`StructuredRequests.step`)
    req_ids: list[str]       # the batch's, in batch order
    starts: np.ndarray       # [num_reqs] int32: each prompt's length
    width: int               # columns copied: an output ending past them is not here
    ends: torch.Tensor       # [num_reqs] int32 on the host: each total length
    tokens: torch.Tensor     # [num_reqs, width] int32 on the host
    event: object | None     # the copy's CUDA event; None: copied already

    def outputs(self) -> dict[str, np.ndarray | None]:
        """{req_id: output so far (None: none yet)}, once copied; a request
        whose output ends past `width` is left out (read from the device)."""
        if self.event is not None:
            self.event.synchronize()
        ends, tokens = self.ends.numpy(), self.tokens.numpy()
        found = {}
        for i, req_id in enumerate(self.req_ids):
            start, end = int(self.starts[i]), int(ends[i])
            if end <= self.width:
                found[req_id] = tokens[i, start:end] if end > start else None
        return found
