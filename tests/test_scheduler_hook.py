"""Variable-length drafts under vLLM's real Scheduler, AsyncScheduler and ours.

The CPU platform turns async scheduling off, so these tests drive the scheduler
classes directly through the engine-core loop (vllm_specplug/testing/
scheduler_sim.py). Outputs are checked token for token against the scripted
target; "empty slots" are scheduled speculative positions with no draft token.
"""
import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_specplug.integration.scheduler import SpecplugAsyncScheduler
from vllm_specplug.testing import scheduler_sim as sim

K = 4
MAX_TOKENS = 40
PROMPTS = [[5 + i, 6, 7, 8 + i] * (i + 1) for i in range(6)]


def stable_lengths(req_index: int, step: int) -> int:
    return req_index % (K + 1)


def drifting_lengths(req_index: int, step: int) -> int:
    return (req_index + step // 3) % (K + 1)


def run(scheduler_cls, model_dir, rule, async_scheduling=True):
    scheduler = sim.make_scheduler(scheduler_cls, str(model_dir),
                                   async_scheduling=async_scheduling,
                                   num_speculative_tokens=K)
    stats = sim.run(scheduler, PROMPTS, MAX_TOKENS, rule)
    expected = {str(i): [sim.target_token(i, len(p) + j) for j in range(MAX_TOKENS)]
                for i, p in enumerate(PROMPTS)}
    assert stats.outputs == expected, "scheduler produced wrong tokens"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == \
        sim.NUM_BLOCKS - 1, "KV blocks leaked (placeholders out of step)"
    assert not scheduler.requests
    return scheduler, stats


@pytest.mark.parametrize("rule", [stable_lengths, drifting_lengths])
def test_sync_scheduler_schedules_exact_draft_lengths(tiny_model_dir, rule):
    _, stats = run(Scheduler, tiny_model_dir, rule, async_scheduling=False)
    assert stats.num_empty_slots == 0 and stats.num_truncated == 0
    assert stats.num_accepted > 0


def test_vllm_async_scheduler_wastes_slots_on_short_drafts(tiny_model_dir):
    """The problem the hook solves: K slots per request whatever the draft."""
    _, stats = run(AsyncScheduler, tiny_model_dir, stable_lengths)
    assert stats.num_empty_slots > stats.num_spec_slots // 3


def test_hook_reserves_only_the_reported_length(tiny_model_dir):
    _, vllm_stats = run(AsyncScheduler, tiny_model_dir, stable_lengths)
    scheduler, stats = run(SpecplugAsyncScheduler, tiny_model_dir, stable_lengths)
    # Only a request's first decode step, scheduled before any draft length is
    # known, may reserve more slots than its drafts fill.
    first_step_waste = sum(K - stable_lengths(i, 0) for i in range(len(PROMPTS)))
    assert stats.num_empty_slots <= first_step_waste
    assert stats.num_truncated == 0
    assert stats.num_accepted == vllm_stats.num_accepted
    assert stats.num_spec_slots < vllm_stats.num_spec_slots
    assert not scheduler.draft_length_hints, "hints of finished requests kept"


def test_hook_is_lossless_when_lengths_drift(tiny_model_dir):
    _, vllm_stats = run(AsyncScheduler, tiny_model_dir, drifting_lengths)
    _, stats = run(SpecplugAsyncScheduler, tiny_model_dir, drifting_lengths)
    assert stats.num_empty_slots < vllm_stats.num_empty_slots
    assert stats.num_spec_slots < vllm_stats.num_spec_slots


def test_hook_equals_async_scheduler_for_full_drafts(tiny_model_dir):
    _, vllm_stats = run(AsyncScheduler, tiny_model_dir, lambda r, s: K)
    _, stats = run(SpecplugAsyncScheduler, tiny_model_dir, lambda r, s: K)
    assert stats == vllm_stats


def test_hook_reads_lengths_from_the_engine_core_paths(tiny_model_dir):
    from vllm.v1.outputs import DraftTokenIds

    scheduler = sim.make_scheduler(SpecplugAsyncScheduler, str(tiny_model_dir),
                                   async_scheduling=True, num_speculative_tokens=K)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4), None))
    scheduler.update_draft_token_ids(DraftTokenIds(["a", "gone"], [[7, 8], [9]]))
    assert scheduler.draft_length_hints == {"a": 2}
