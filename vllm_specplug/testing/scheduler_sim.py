"""Drive vLLM's real schedulers with a scripted worker, as the engine core would.

Async scheduling is off on vLLM's CPU platform, so the scheduler hook is tested
here: the scheduler classes are vLLM's own (or our subclass), the engine-core
loop is reproduced (sync: output then drafts; async: a batch queue of two, the
next step scheduled before the previous output arrives), and the worker is a
deterministic script: the target's next token is a fixed function of
(request, position) and the proposer's draft lengths follow a given rule.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm_specplug.integration.scheduler import DRAFT_LENGTHS_ATTR

# (request index, decode step) -> number of draft tokens the proposer returns
DraftLengthRule = Callable[[int, int], int]
NUM_BLOCKS = 256
BLOCK_SIZE = 16


def make_scheduler(scheduler_cls, model_path: str, *, async_scheduling: bool,
                   num_speculative_tokens: int, max_num_seqs: int = 8):
    from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec)
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = 512
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model_path, tokenizer=model_path,
                                 dtype="float32", max_model_len=max_len, seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=1024,
            max_model_len=max_len, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_min=1, prompt_lookup_max=3))
    # Set after validation: the config refuses async for non-EAGLE methods,
    # and this is exactly the combination the hook is meant to enable.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    attention = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1,
                                  head_size=16, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], attention)])
    return scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                         structured_output_manager=StructuredOutputManager(vllm_config),
                         block_size=BLOCK_SIZE)


def target_token(req_index: int, position: int) -> int:
    """The scripted target model's greedy token at `position`."""
    return 100 + (req_index * 31 + position * 7) % 50


@dataclass
class SimStats:
    num_spec_slots: int = 0      # speculative slots the scheduler scheduled
    num_empty_slots: int = 0     # slots without a draft token behind them
    num_truncated: int = 0       # draft tokens dropped for lack of slots
    num_accepted: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class _ReqState:
    index: int
    prompt_len: int
    num_prefilled: int = 0
    num_decode_steps: int = 0
    tokens: list[int] = field(default_factory=list)   # prompt + sampled
    draft: list[int] = field(default_factory=list)    # for the next step


class ScriptedWorker:
    """Executes scheduler outputs: verifies drafts against `target_token`."""

    def __init__(self, draft_length: DraftLengthRule, *, async_scheduling: bool,
                 stats: SimStats) -> None:
        self.draft_length = draft_length
        self.async_scheduling = async_scheduling
        self.stats = stats
        self.states: dict[str, _ReqState] = {}

    def execute(self, scheduler_output):
        from vllm.v1.outputs import ModelRunnerOutput

        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.states[new.req_id] = _ReqState(
                int(new.req_id), len(new.prompt_token_ids),
                tokens=list(new.prompt_token_ids))
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled, lengths = [], {}
        for req_id in req_ids:
            state = self.states[req_id]
            num_tokens = scheduler_output.num_scheduled_tokens[req_id]
            spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            sampled.append(self._step(state, num_tokens, spec))
            if sampled[-1]:
                lengths[req_id] = self._propose(state)
        output = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled)
        setattr(output, DRAFT_LENGTHS_ATTR, lengths)
        return output

    def _step(self, state: _ReqState, num_tokens: int, spec: list[int]) -> list[int]:
        if state.num_prefilled < state.prompt_len:
            state.num_prefilled += num_tokens
            if state.num_prefilled < state.prompt_len:
                return []               # a prefill chunk samples nothing
            return self._commit(state, [])
        assert num_tokens == 1 + len(spec), (num_tokens, spec)
        # Sync: the scheduler holds the drafts. Async: only -1 placeholders do,
        # and the worker uses the drafts it kept (as vLLM's GPU runner does).
        draft = [t for t in spec if t >= 0] if not self.async_scheduling else state.draft
        used = draft[:len(spec)]
        self.stats.num_spec_slots += len(spec)
        self.stats.num_empty_slots += len(spec) - len(used)
        self.stats.num_truncated += len(draft) - len(used)
        return self._commit(state, used)

    def _commit(self, state: _ReqState, draft: list[int]) -> list[int]:
        out = []
        for token in draft:
            if token != target_token(state.index, len(state.tokens) + len(out)):
                break
            out.append(token)
        self.stats.num_accepted += len(out)
        out.append(target_token(state.index, len(state.tokens) + len(out)))
        state.tokens.extend(out)
        return out

    def _propose(self, state: _ReqState) -> int:
        """Draft the next step: a correct prefix, then a wrong token."""
        length = self.draft_length(state.index, state.num_decode_steps)
        state.num_decode_steps += 1
        position = len(state.tokens)
        state.draft = [target_token(state.index, position + i) for i in range(length)]
        if length >= 3:
            state.draft[-1] += 1
        return length

    def drafts(self):
        from vllm.v1.outputs import DraftTokenIds

        req_ids = list(self.states)
        return DraftTokenIds(req_ids, [list(self.states[r].draft) for r in req_ids])


def run(scheduler, prompts: list[list[int]], max_tokens: int,
        draft_length: DraftLengthRule) -> SimStats:
    """Run every prompt to `max_tokens` through the engine-core loop."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    async_scheduling = scheduler.scheduler_config.async_scheduling
    stats = SimStats()
    worker = ScriptedWorker(draft_length, async_scheduling=async_scheduling,
                            stats=stats)
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                ignore_eos=True)
        scheduler.add_request(Request(str(index), prompt, params, None))
    if async_scheduling:
        _async_loop(scheduler, worker, stats)
    else:
        _sync_loop(scheduler, worker, stats)
    return stats


def _collect(engine_outputs, stats: SimStats) -> None:
    for outputs in engine_outputs.values():
        for out in outputs.outputs:
            stats.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)


def _sync_loop(scheduler, worker: ScriptedWorker, stats: SimStats) -> None:
    while scheduler.has_requests():
        scheduler_output = scheduler.schedule()
        output = worker.execute(scheduler_output)
        _collect(scheduler.update_from_output(scheduler_output, output), stats)
        scheduler.update_draft_token_ids(worker.drafts())


def _async_loop(scheduler, worker: ScriptedWorker, stats: SimStats) -> None:
    in_flight: deque = deque()
    while scheduler.has_requests() or in_flight:
        if scheduler.has_requests():
            scheduler_output = scheduler.schedule()
            in_flight.append((scheduler_output, worker.execute(scheduler_output)))
            if len(in_flight) < 2:
                continue
        scheduler_output, output = in_flight.popleft()
        _collect(scheduler.update_from_output(scheduler_output, output), stats)
