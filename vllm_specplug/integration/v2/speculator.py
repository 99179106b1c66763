"""Our proposers under vLLM's Model Runner V2 (CUDA): a `BaseSpeculator`.

Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`) calls
`speculator.propose(...)` once per step, after it has written the step's
sampled tokens into `req_states.all_token_ids` and advanced `total_len`, and
expects a `[num_reqs, K]` int64 draft tensor on the GPU, which it scatters
into `req_states.draft_tokens`. Our proposers run on the host, so each step:

1. one device-to-host copy brings, per request, `num_sampled`, `total_len`
   and the (at most K+1) tokens appended this step;
2. `HostHistories` mirrors every request's history on the host (a request
   seen for the first time, or moved to another state slot, is read whole
   once); requests gone from `req_states` are stopped;
3. the shared `ProposerSession` (session.py) updates the proposer, calls
   `propose` for requests that sampled a token, and validates the drafts;
4. drafts are padded to K with the history's last token (a padded slot is
   an ordinary draft token: verification rejects or accepts it losslessly),
   copied to the GPU, and their true lengths kept for the scheduler:
   `take_draft_token_ids` (sync scheduling) and the step output's
   `specplug_draft_lengths` (async scheduling, `SpecplugAsyncScheduler`),
   both through `patches/gpu_v2_model_runner.py`.

With the target sharded (tensor parallelism), only the first rank drafts on
the host; a broadcast over the ranks' group gives the others its padded
drafts (`FirstRankShare`, integration/first_rank.py). Every rank feeds its
own `req_states.draft_tokens` to the next forward, so ranks whose
controllers timed their own steps and cut drafts differently would verify
different tokens; and the others would only repeat the first rank's work.

A proposer that offers a `device_drafter` (specplug_ngram) skips all of that:
its kernels read `req_states.all_token_ids` where vLLM keeps it and write the
padded drafts in place, with no host synchronisation, as vLLM's own GPU
n-gram does; the scheduler then reserves K slots per request.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from vllm_specplug.integration.batch_schedule import BatchPolicyView
from vllm_specplug.integration.first_rank import FirstRankShare
from vllm_specplug.integration.grammar_drafting import prefix_check
from vllm_specplug.integration.session import ProposerSession, read_only, read_only_rows
from vllm_specplug.integration.v2.structured import StructuredRequests
from vllm_specplug.proposers.base import DeviceProposeBatch, ProposeBatch, StopReason

# A request slot in req_states that holds no request we know of.
NO_REQUEST = -1
# "1": draft on the host even where the proposer can draft on the device
# (to measure what device drafting buys; benchmarks/gpu/).
HOST_DRAFTING_ENV = "VLLM_SPECPLUG_HOST_DRAFTING"


class HostHistories:
    """Host copies of the histories (prompt + accepted tokens) of the requests
    in Model Runner V2's state slots, indexed like `req_states`."""

    def __init__(self, max_num_reqs: int, max_model_len: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.slot_of: dict[str, int] = {}  # req_id -> state slot it was read from

    def knows(self, req_id: str, slot: int) -> bool:
        return self.slot_of.get(req_id, NO_REQUEST) == slot

    def load(self, req_id: str, slot: int, history: np.ndarray) -> None:
        self.token_ids[slot, :len(history)] = history
        self.num_tokens[slot] = len(history)
        self.slot_of[req_id] = slot

    def append(self, slot: int, new_token_ids: np.ndarray, total_len: int) -> None:
        start = total_len - len(new_token_ids)
        self.token_ids[slot, start:total_len] = new_token_ids
        self.num_tokens[slot] = total_len

    def forget(self, req_id: str) -> None:
        self.slot_of.pop(req_id, None)


def gather_step_tokens(all_token_ids: torch.Tensor, total_len: torch.Tensor,
                       idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                       max_new: int) -> np.ndarray:
    """[num_reqs, 2 + max_new] int64 on the host: num_sampled, total_len and
    the last `max_new` token slots of each request (its new tokens are the
    last num_sampled of them). One device-to-host copy.

    all_token_ids: [max_num_reqs, max_model_len] int32; total_len:
    [max_num_reqs] int32; idx_mapping: [num_reqs] int (batch row -> slot);
    num_sampled: [num_reqs] int32.
    """
    slots = idx_mapping.long()
    lens = total_len[slots].long()
    offsets = torch.arange(-max_new, 0, device=lens.device)
    positions = (lens[:, None] + offsets[None, :]).clamp_(min=0)
    flat = slots[:, None] * all_token_ids.stride(0) + positions
    tokens = all_token_ids.reshape(-1)[flat].long()
    packed = torch.cat([num_sampled.long()[:, None], lens[:, None], tokens], dim=1)
    return packed.cpu().numpy()


def lengths_reach_scheduler(scheduler_config) -> bool:
    """Whether the next steps are sized by our drafts' lengths: sync
    scheduling, or `SpecplugAsyncScheduler` (a subclass or its path)."""
    if not scheduler_config.async_scheduling:
        return True
    cls = scheduler_config.scheduler_cls
    if cls is None:
        return False
    if isinstance(cls, str):
        return cls.rsplit(".", 1)[-1] == "SpecplugAsyncScheduler"
    return any(c.__name__ == "SpecplugAsyncScheduler" for c in getattr(cls, "__mro__", ()))


class V2SpeculatorHooks(BatchPolicyView):
    """What Model Runner V2 asks of every speculator (`BaseSpeculator`,
    duck-typed: vLLM's ABC needs no registration) besides `propose`, as our
    speculators answer it: no multimodal inputs, no draft probabilities
    (verification uses the target alone), one query row per request, and no
    CUDA graphs for vLLM to capture (ours capture their own, lazily)."""

    supports_mm_inputs = False
    draft_logits = None
    num_query_per_req = 1
    num_extra_query_per_req = 0
    # whether `propose` scans the requests' token histories on the device
    # each step: they are then kept in GPU memory (v2/token_history.py)
    scans_token_histories = False

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        del cudagraph_mode

    def capture(self) -> None:
        return None

    def prepare_watermarking(self, *args, **kwargs) -> None:
        raise RuntimeError("vllm-specplug speculators do not support watermarking")

    def schedule(self, scheduler_output, req_states) -> None:
        """Called by our runner patch with each scheduler output before the
        runner applies it (block ids, finished requests)."""
        del scheduler_output, req_states


class SpecplugV2Speculator(V2SpeculatorHooks):
    """Drafts with a vllm-specplug proposer. Built by the patched
    `init_speculator` when the speculative config selects one of ours."""

    def __init__(self, vllm_config, device: torch.device, req_states,
                 use_device_drafter: bool | None = None,
                 shared: FirstRankShare | None = None) -> None:
        self.session = ProposerSession(vllm_config)
        self.req_states = req_states
        self.device = device
        self.num_speculative_steps = vllm_config.speculative_config.num_speculative_tokens
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        lengths_sized = lengths_reach_scheduler(vllm_config.scheduler_config)
        if use_device_drafter is None:  # per-request cuts need the drafts on the host
            use_device_drafter = (device.type == "cuda"
                                  and not (self.session.adaptive_mode == "on" and lengths_sized)
                                  and os.environ.get(HOST_DRAFTING_ENV) != "1")
        self.device_drafter = (self.session.proposer.device_drafter(max_num_reqs)
                               if use_device_drafter else None)
        # device drafts are computed alike on every rank from the same tokens
        self.shared = shared if self.device_drafter is None else None
        if self.device_drafter is not None or not lengths_sized:
            # device drafts never reach the host: nothing for the controller
            # to cut without a synchronisation (the host path adapts); and
            # where the scheduler reserves K slots whatever the lengths, a
            # cut token would be padded and verified all the same (there the
            # batch's K is chosen per step instead: integration/batch_schedule)
            self.session.adaptive = None
        self.stats = SpeculatorStats(device)
        if self.device_drafter is None:  # the host path mirrors every history
            self.histories = HostHistories(max_num_reqs, vllm_config.model_config.max_model_len)
            self.drafts_cpu = torch.zeros(max_num_reqs, self.num_speculative_steps,
                                          dtype=torch.int64, pin_memory=device.type == "cuda")
        self.drafts = torch.zeros(max_num_reqs, self.num_speculative_steps,
                                  dtype=torch.int64, device=device)
        self.num_draft = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        # [max_num_reqs, K]: vLLM reads this only with adaptive verification
        self.draft_token_confidence_probs = torch.ones_like(self.drafts, dtype=torch.float32)
        self.last_req_ids: list[str] = []
        self.last_drafts: list[list[int]] = []
        self.pending_lengths: dict[str, int] | None = None
        # the drafter's own grammar per structured request, for a host
        # proposer that prefers drafts the grammar allows (suffix, hybrid;
        # grammar_drafting.py)
        self.structured = (StructuredRequests(vllm_config) if self.device_drafter is None
                           and self.session.proposer.reads_grammars else None)

    @property
    def scans_token_histories(self) -> bool:
        return self.device_drafter is not None  # its kernels scan every history

    def schedule(self, scheduler_output, req_states) -> None:
        """The structured requests' params, which Model Runner V2 does not
        keep (structured.py)."""
        del req_states
        if self.structured is not None:
            self.structured.schedule(scheduler_output)

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        num_reqs = input_batch.num_reqs
        if dummy_run:  # profiling, warm-up, DP padding: no requests
            return self.drafts[:num_reqs]
        started = time.perf_counter()
        if self.device_drafter is not None:
            drafts = self._propose_on_device(input_batch, num_sampled[:num_reqs])
        elif self.shared is not None and not self.shared.decides_here:
            drafts = self.drafts[:num_reqs]  # filled by the broadcast below
        else:
            drafts = self._propose_on_host(input_batch, last_hidden_states, num_sampled,
                                           num_rejected, num_speculative_tokens)
        if self.shared is not None:
            self.shared.broadcast(drafts)
        self.stats.host_seconds += time.perf_counter() - started
        self.stats.num_steps += 1
        return drafts

    def _last_tokens(self, input_batch) -> torch.Tensor:
        """[num_reqs] int64 on the device: each request's last token."""
        return self.req_states.last_sampled_tokens.view(-1)[input_batch.idx_mapping]

    def _propose_on_device(self, input_batch, num_sampled: torch.Tensor) -> torch.Tensor:
        """Every launch here lands on the step's critical path when the target
        is small (host-bound), so the common case is the drafter's own."""
        num_reqs = input_batch.num_reqs
        drafts, num_draft = self.drafts[:num_reqs], self.num_draft[:num_reqs]
        batch = DeviceProposeBatch(list(input_batch.req_ids), self.req_states.all_token_ids.gpu,
                                   input_batch.idx_mapping, self.req_states.total_len.gpu,
                                   num_sampled, self.stats.device_counts)
        ok = not self.session.guard.disabled and self.session.guard.call(
            "propose", batch.req_ids, self.device_drafter.propose, batch, drafts, num_draft)[0]
        if not ok:  # failed or switched off: last-token drafts, rejected as any other
            drafts.copy_(self._last_tokens(input_batch)[:, None].expand_as(drafts))
        elif not self.device_drafter.trusted:
            # A third party's ids outside the vocabulary would index past the
            # embedding: such slots get the last token (no host sync to check).
            bad = (drafts < 0) | (drafts >= self.session.vocab_size)
            torch.where(bad, self._last_tokens(input_batch)[:, None], drafts, out=drafts)
        return drafts

    def _propose_on_host(self, input_batch, last_hidden_states, num_sampled, num_rejected,
                         num_speculative_tokens) -> torch.Tensor:
        num_reqs = input_batch.num_reqs
        if self.session.guard.disabled:  # switched off: empty drafts from now on
            self._keep(list(input_batch.req_ids), [[] for _ in range(num_reqs)])
            drafts = self.drafts[:num_reqs]
            return drafts.copy_(self._last_tokens(input_batch)[:, None].expand_as(drafts))
        k = self.num_speculative_steps if num_speculative_tokens is None else \
            num_speculative_tokens
        started = time.perf_counter()   # the copy waits for the step's GPU work
        step = gather_step_tokens(self.req_states.all_token_ids.gpu,
                                  self.req_states.total_len.gpu, input_batch.idx_mapping,
                                  num_sampled[:num_reqs], self.num_speculative_steps + 1)
        self.stats.wait_seconds += time.perf_counter() - started
        req_ids = list(input_batch.req_ids)
        slots = np.asarray(input_batch.idx_mapping_np[:num_reqs], dtype=np.int64)
        self.session.begin_step(int(input_batch.num_tokens))
        self._retire()
        self._track(req_ids, slots, step)
        hidden = self._hidden(input_batch, last_hidden_states, num_rejected, num_reqs)
        drafts = self._draft(req_ids, slots, step, k, hidden)
        self.stats.add_host(drafts, step[:, 0], self.num_speculative_steps)
        return self._to_device(req_ids, slots, drafts, k)

    def _retire(self) -> None:
        """Stop requests vLLM removed (finished, aborted or preempted: a
        preempted request comes back as new, in a fresh slot)."""
        live = self.req_states.req_id_to_index
        for req_id in [r for r in self.session.active if r not in live]:
            self.session.stop(req_id, StopReason.FINISHED)
            self.histories.forget(req_id)

    def _track(self, req_ids: list[str], slots: np.ndarray, step: np.ndarray) -> None:
        for req_id, slot, row in zip(req_ids, slots, step):
            num_new, total_len = int(row[0]), int(row[1])
            if num_new == 0 or self.session.guard.disabled:
                continue  # a prefill chunk: nothing sampled, nothing to track
            slot = int(slot)
            if req_id in self.session.active and self.histories.knows(req_id, slot):
                new = row[len(row) - num_new:]
                self.histories.append(slot, new, total_len)
                self.session.update(req_id, new.tolist())
                continue
            if req_id in self.session.active:  # moved to another slot: start again
                self.session.stop(req_id, StopReason.PREEMPTED)
            history = self.req_states.all_token_ids.gpu[slot, :total_len].cpu().numpy()
            self.histories.load(req_id, slot, history)
            self.session.start(req_id, history, int(self.req_states.prompt_len.np[slot]))

    def _hidden(self, input_batch, last_hidden_states, num_rejected, num_reqs):
        """[num_reqs, hidden] target hidden state at each request's last
        accepted position (query end - 1 - rejected drafts), for proposers
        that ask for it."""
        if not self.session.uses_hidden_states:
            return None
        ends = input_batch.query_start_loc[1:num_reqs + 1].long()
        return last_hidden_states[ends - 1 - num_rejected[:num_reqs].long()]

    def _draft(self, req_ids, slots, step, k, hidden) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in req_ids]
        lens = step[:, 1]
        rows = [i for i, req_id in enumerate(req_ids)
                if step[i, 0] > 0 and lens[i] < self.session.max_model_len
                and req_id in self.session.active and self.session.can_draft(req_id)]
        if not rows or k <= 0:
            return drafts
        batch = ProposeBatch([req_ids[i] for i in rows],
                             read_only_rows(self.histories.token_ids, slots[rows], lens[rows]),
                             read_only(lens[rows].astype(np.int64)), k,
                             None if hidden is None else hidden[rows])
        if self.structured:
            # a grammar's fault costs this step its checks, never the engine
            ok, checks = self.session.guard.call(
                "grammar_checks", batch.req_ids, self._valid_prefixes, batch.req_ids,
                slots[rows], lens[rows], effect="its drafts go unchecked this step")
            batch.valid_prefix.update(checks if ok else {})
        for i, draft in zip(rows, self.session.draft(batch, len(req_ids))):
            drafts[i] = draft
        return drafts

    def _valid_prefixes(self, req_ids: list[str], slots: np.ndarray, lens: np.ndarray) -> dict:
        """{batch row: how many leading tokens of a draft the request's
        grammar allows after its output} for the structured requests
        (`ProposeBatch.valid_prefix`), as the V1 drafter gives them."""
        checks = {}
        for j, (req_id, slot, num_tokens) in enumerate(zip(req_ids, slots, lens)):
            if req_id not in self.structured.params:
                continue
            start = int(self.req_states.prompt_len.np[slot])
            grammar = self.structured.grammar(req_id,
                                              self.histories.token_ids[slot, start:num_tokens])
            if grammar is not None:
                checks[j] = prefix_check(grammar)
        return checks

    def _to_device(self, req_ids, slots, drafts, k) -> torch.Tensor:
        num_reqs = len(req_ids)
        out = self.drafts_cpu[:num_reqs].numpy()
        for i, (slot, draft) in enumerate(zip(slots, drafts)):
            last = self.histories.token_ids[slot, max(self.histories.num_tokens[slot] - 1, 0)]
            out[i, :] = last
            out[i, :len(draft)] = draft
        self.drafts[:num_reqs].copy_(self.drafts_cpu[:num_reqs], non_blocking=True)
        self._keep(req_ids, [d[:k] for d in drafts])
        return self.drafts[:num_reqs]

    def _keep(self, req_ids: list[str], drafts: list[list[int]]) -> None:
        self.last_req_ids, self.last_drafts = req_ids, drafts
        self.pending_lengths = {r: len(d) for r, d in zip(req_ids, drafts)}

    def take_drafts(self) -> tuple[list[str], list[list[int]]] | None:
        """The last step's drafts at their true lengths, once (sync
        scheduling); None on the device path (vLLM reports K slots then)."""
        if self.device_drafter is not None:
            return None
        req_ids, drafts = self.last_req_ids, self.last_drafts
        self.last_req_ids, self.last_drafts = [], []
        return req_ids, drafts

    def take_draft_lengths(self) -> dict[str, int] | None:
        """{req_id: draft length} of the last step, once (async scheduling)."""
        lengths, self.pending_lengths = self.pending_lengths, None
        return lengths


class SpeculatorStats:
    """What a step of ours costs and fills, read by benchmarks (the worker
    probe's `specplug_speculator_stats`). Device counts stay on the device
    until read, so counting adds no synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.num_steps = 0
        self.host_seconds = 0.0          # wall time inside propose (launches only, on device)
        self.wait_seconds = 0.0          # of which waiting for the GPU (host path's copy)
        # [2] int64: draft tokens proposed, draft slots offered (K per drafting
        # row), added to by device drafters that count (DeviceProposeBatch)
        self.device_counts = torch.zeros(2, dtype=torch.int64, device=device)
        self.host_counts = np.zeros(2, dtype=np.int64)
        self.deferred = None  # a head's kept rows (v2/deferred_rows.py): their counts
        self.grammar_choices = None  # a head's GrammarChoices (grammar_choices.py)
        self.draft_grammars = None  # a head's DraftGrammars (grammar_drafting.py)
        # constrained requests' verification rows filled in the worker
        # (worker_rows.py): of them, those whose drafts were known (else
        # none of their drafts may be accepted), those whose output was read
        # from the device then (a wait for the step's forward), the draft
        # rows left unfilled (past what was known or `RowDepth`'s depth),
        # and the host time it took
        self.worker_rows = np.zeros(4, dtype=np.int64)
        self.worker_rows_seconds = 0.0

    def add_host(self, drafts: list[list[int]], num_sampled: np.ndarray, k: int) -> None:
        self.host_counts += (sum(len(d) for d in drafts), int((num_sampled > 0).sum()) * k)

    def as_dict(self) -> dict:
        tokens, slots = self.host_counts + self.device_counts.cpu().numpy()
        stats = {"num_steps": self.num_steps, "host_seconds": self.host_seconds,
                 "wait_seconds": self.wait_seconds,
                 "num_draft_tokens": int(tokens), "num_draft_slots": int(slots),
                 "num_worker_rows_requests": int(self.worker_rows[0]),
                 "num_worker_rows_with_drafts": int(self.worker_rows[1]),
                 "num_worker_rows_device_reads": int(self.worker_rows[2]),
                 "num_worker_draft_rows_unfilled": int(self.worker_rows[3]),
                 "worker_rows_seconds": self.worker_rows_seconds}
        if self.grammar_choices is not None:  # grammar_verify "choices" (grammar_choices.py)
            num_requests, num_top, num_full = self.grammar_choices.counts.tolist()
            stats.update(num_choice_requests=num_requests, num_choice_top_nodes=num_top,
                         num_choice_full_rows=num_full,
                         num_choice_steps_with_rows=self.grammar_choices.num_steps_with_rows)
        if self.draft_grammars is not None:  # the drafter's grammars advanced without a read
            stats.update(num_known_outputs=self.draft_grammars.num_known_advances,
                         num_known_output_repairs=self.draft_grammars.num_known_repairs)
        if self.deferred is not None:
            stats.update(num_kept_steps=self.deferred.num_kept_steps,
                         num_kept_by_graph=self.deferred.num_replayed,
                         num_flushes=self.deferred.num_flushes)
        return stats
