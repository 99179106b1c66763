"""The scheduler side of one draft length per step (integration/batch_schedule.py;
issue 27): the table that makes vLLM capture each candidate, what each step's
output tells the policy (times, kinds, accepted counts), the policy's channel
to a server's /metrics, and what `bench` reports of it. The policy itself on a
simulated engine: tests/test_batch_draft_length_unit.py and
tests/test_batch_draft_length_phases_unit.py."""
from __future__ import annotations

import pytest

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates
from vllm_specplug.adaptive.wave_focus import RequestGains


@pytest.mark.parametrize("max_k", [1, 3, 5, 15])
def test_capture_table_puts_every_candidate_in_vllms_lookup(max_k):
    """vLLM builds its capture families and its dense lookup from the table
    (`build_dynamic_sd_schedule_lookup`): each candidate must be in it."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from vllm_specplug.integration.batch_schedule import capture_table, table_lengths

    candidates = draft_length_candidates(max_k)
    assert candidates[0] == 0 and candidates[-1] == max_k
    table = capture_table(candidates, max_num_seqs=256)
    dense = build_dynamic_sd_schedule_lookup(table, vllm_max_batch_size=256,
                                             vllm_num_speculative_tokens=max_k)
    assert set(dense[1:]) == set(candidates) == set(table_lengths(table))


def test_the_scheduler_does_not_time_the_first_step_at_a_shape():
    """`BatchDraftSchedule._observe` on scheduler outputs of 20 then 21 pure
    decode requests at K=4 (one padded size, 24) and then 30 (32): the first
    step at each padded size is not timed (the head captures its graph
    there), every later one is."""
    from types import SimpleNamespace

    from vllm_specplug.integration.batch_schedule import BatchDraftSchedule

    scheduler = SimpleNamespace(gains=RequestGains(), draft_length=BatchDraftLength((0, 4)), _channel=None,
                                _shapes_seen=set(),
                                _drafted_before=None)

    def step(num_reqs: int) -> None:
        spec = {f"r{i}": [7] * 4 for i in range(num_reqs)}
        output = SimpleNamespace(scheduled_spec_decode_tokens=spec,
                                 num_scheduled_tokens={r: 5 for r in spec},
                                 total_num_scheduled_tokens=5 * num_reqs,
                                 finished_req_ids=(), num_spec_tokens_to_schedule=4)
        runner = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(spec)},
                                 sampled_token_ids=[[1, 2]] * num_reqs)
        BatchDraftSchedule._observe(scheduler, output, runner, 0.01)

    scheduler._first_at_shape = lambda k, out: BatchDraftSchedule._first_at_shape(
        scheduler, k, out)
    scheduler._maybe_log = lambda: None
    for num_reqs in (20, 21, 20, 30, 30):
        step(num_reqs)
    stats = scheduler.draft_length.stats
    assert (stats.num_first_at_shape, stats.num_measured) == (2, 3)


def test_every_steps_time_is_added_to_its_kind():
    """A phase's time beyond its timed decode steps (H200, batch 256: the
    policy's decode steps explained about half of it) is found in the
    policy's counters: each step's interval is added to pure decode at one
    length, a change of length, or a step with prefill tokens."""
    from types import SimpleNamespace

    from vllm_specplug.integration.batch_schedule import BatchDraftSchedule

    scheduler = SimpleNamespace(gains=RequestGains(), draft_length=BatchDraftLength((0, 4)), _channel=None,
                                _shapes_seen=set(),
                                _drafted_before=None, _maybe_log=lambda: None)
    scheduler._first_at_shape = lambda k, out: BatchDraftSchedule._first_at_shape(
        scheduler, k, out)
    spec = {f"r{i}": [7] * 4 for i in range(8)}

    def step(k_next: int, prefill_tokens: int, seconds: float) -> None:
        output = SimpleNamespace(scheduled_spec_decode_tokens=spec,
                                 num_scheduled_tokens={r: 5 for r in spec},
                                 total_num_scheduled_tokens=5 * len(spec) + prefill_tokens,
                                 finished_req_ids=(), num_spec_tokens_to_schedule=k_next)
        runner = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(spec)},
                                 sampled_token_ids=[[1, 2]] * len(spec))
        BatchDraftSchedule._observe(scheduler, output, runner, seconds)

    # the sixth step is the first that verifies and drafts 4 after the
    # change: a switch still (not settled), and not timed
    for k_next, prefill_tokens, seconds in ((4, 0, 0.01), (4, 0, 0.02), (4, 30, 0.5),
                                            (0, 0, 0.04), (4, 0, 0.08), (4, 0, 0.16),
                                            (4, 0, 0.32)):
        step(k_next, prefill_tokens, seconds)
    counters = scheduler.draft_length.counters()
    assert (counters["decode_steps"], counters["switch_steps"], counters["mixed_steps"]) \
        == (3, 3, 1)
    assert counters["decode_seconds"] == pytest.approx(0.35)
    assert counters["switch_seconds"] == pytest.approx(0.28)
    assert counters["mixed_seconds"] == pytest.approx(0.5)
    # of the settled decode steps the first at its shape is not timed either
    assert (counters["num_measured"], counters["num_first_at_shape"]) == (2, 1)
    # the scheduler's own time in the policy (issue 26: host work per step)
    observed = counters["host_seconds"]
    assert 0 < observed < 0.28
    assert scheduler.draft_length[8] in (0, 4)  # vLLM's lookup is timed too
    assert scheduler.draft_length.counters()["host_seconds"] > observed


def test_the_first_step_after_the_engine_idled_is_not_timed():
    """The interval before the first output of a new batch of requests holds
    the wait for them (bench: the time between two phases), not a step. What
    that first step took from its schedule is counted apart ("first": on the
    H200 the adaptive tree's `generate` calls took 18-27 ms more each than the
    static tree's, outside its timed steps; docs/results/batch_draft_length_h200_run11)."""
    from types import SimpleNamespace

    from vllm_specplug.integration.batch_schedule import BatchDraftSchedule

    class Engine:
        pending = True

        def schedule(self):
            return SimpleNamespace(total_num_scheduled_tokens=5)

        def update_from_output(self, scheduler_output, model_runner_output):
            return "outputs"

        def has_unfinished_requests(self) -> bool:
            return self.pending

    class Clocked(BatchDraftSchedule, Engine):
        def _observe(self, scheduler_output, model_runner_output, seconds):
            self.intervals.append(seconds)

    scheduler = object.__new__(Clocked)
    scheduler.intervals, scheduler._last_output_at = [], None
    scheduler._busy_since, scheduler.draft_length = None, BatchDraftLength((0, 4))
    for pending in (True, False, True):
        scheduler.pending = pending
        scheduler.schedule()  # a busy spell starts at the first schedule only
        assert scheduler.update_from_output(None, None) == "outputs"
    assert scheduler.intervals[0] is None and scheduler.intervals[1] is not None
    assert scheduler.intervals[2] is None
    stats = scheduler.draft_length.stats
    assert stats.first_steps == 2 and 0 < stats.first_seconds < 1
    assert scheduler.draft_length.counters()["first_steps"] == 2


def test_steps_where_some_requests_drafted_nothing_are_timed_and_counted():
    """n-gram and suffix find no draft for many requests. On SmolLM2 at batch
    16 and 80 (docs/results/batch_draft_length_cpu_run2, smollm2_no_cache)
    no step had every request drafting, so none was timed and the policy
    never tried another length while speculation lost 20%. Now a pure decode
    step is timed whoever drafted, and a decoding request with no draft
    counts as accepting nothing at the K it was asked for: 16 decodes at
    K=4, half of them drafting and accepting 1, expect 1.5 tokens each."""
    from types import SimpleNamespace

    from vllm_specplug.integration.batch_schedule import BatchDraftSchedule

    scheduler = SimpleNamespace(gains=RequestGains(), draft_length=BatchDraftLength((0, 4)), _channel=None,
                                _shapes_seen=set(),
                                _drafted_before=None, _maybe_log=lambda: None)
    scheduler._first_at_shape = lambda k, out: BatchDraftSchedule._first_at_shape(
        scheduler, k, out)
    req_ids = [f"r{i}" for i in range(16)]
    spec = {r: [7] * 4 for r in req_ids[:8]}
    output = SimpleNamespace(scheduled_spec_decode_tokens=spec,
                             num_scheduled_tokens={r: 5 if r in spec else 1 for r in req_ids},
                             total_num_scheduled_tokens=16 + 4 * 8,
                             finished_req_ids=(), num_spec_tokens_to_schedule=4)
    runner = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[1, 2]] * 8 + [[1]] * 8)
    for _ in range(5):
        BatchDraftSchedule._observe(scheduler, output, runner, 0.01)
    policy = scheduler.draft_length
    assert (policy.stats.num_first_at_shape, policy.stats.num_measured) == (1, 4)
    assert policy.expected_tokens(4) == pytest.approx(1.5)


def test_bench_sums_the_policys_counts_over_repeats_and_reports_them():
    """`bench offline` reads the counters before and after each repeat (from
    the workers) and sums the differences; its table shows the share of
    steps per length and expected vs realised tokens per request."""
    from types import SimpleNamespace

    from vllm_specplug.bench.offline import batch_policy_delta
    from vllm_specplug.bench.report import format_batch_policy_table

    def counters(current, steps, chosen, expected, realised, requests):
        return {"current": current, "num_steps": steps, "num_explored": steps // 8,
                "num_measured": steps, "num_stalled": 0, "num_first_at_shape": 1,
                "chosen": chosen, "expected_tokens": expected, "realised_tokens": realised,
                "num_requests": requests}

    first = batch_policy_delta(None, counters(4, 10, {0: 2, 4: 8}, 30.0, 28.0, 10),
                               counters(4, 30, {0: 2, 4: 28}, 90.0, 80.0, 30))
    total = batch_policy_delta(first, counters(4, 30, {0: 2, 4: 28}, 90.0, 80.0, 30),
                               counters(0, 50, {0: 22, 4: 28}, 110.0, 100.0, 50))
    assert total["chosen"] == {0: 20, 4: 20} and total["num_steps"] == 40
    assert total["current"] == 0 and total["expected_tokens"] == 80.0
    # what it expects of each length and its step times: as of the last read
    late = {**counters(0, 60, {0: 32, 4: 28}, 120.0, 110.0, 60),
            "expected_per_length": {0: 1.0, 4: 2.5}, "step_ms": {"0@16": 3.0, "4@16": 5.0}}
    assert batch_policy_delta(total, counters(0, 50, {0: 22, 4: 28}, 110.0, 100.0, 50),
                              late)["step_ms"] == {"0@16": 3.0, "4@16": 5.0}
    assert batch_policy_delta(total, None, None) is total
    row = SimpleNamespace(name="ours-tree16-adaptive", batch_size=16, error=None,
                          batch_policy=total)
    table = format_batch_policy_table([row, SimpleNamespace(name="none", batch_size=16,
                                                            error=None, batch_policy=None)])
    assert "ours-tree16-adaptive" in table and "none" not in table
    assert "0:50% 4:50%" in table and "trying" not in table and "2.00/1.80" in table, table
    assert "focused" not in table  # a record from before wave_focus.py, or none focused
    row.batch_policy = {**total, "num_focused": 4, "focus_ratio_sum": 1.0}
    assert "focused:4(r 0.25)" in format_batch_policy_table([row])


def test_bench_reports_the_heads_graphs_captured_in_service_per_row():
    """`bench offline` sums the head's captures in service over a row's
    repeats (each stalled a step) and lists the rows that had any counter."""
    from types import SimpleNamespace

    from vllm_specplug.bench.offline import captures_delta
    from vllm_specplug.bench.report import format_captures_table

    def read(n, seconds, held, **compiles):
        return {"num_captures": n, "capture_seconds": seconds, "num_graphs": held,
                "kernel_compiles": compiles}

    total = captures_delta(None, read(4, 1.0, 40), read(6, 1.5, 42, verified_rows_kernel=1))
    total = captures_delta(total, read(6, 1.5, 42, verified_rows_kernel=1),
                           read(9, 1.75, 45, verified_rows_kernel=2, head_attention_kernel=1))
    assert total == read(5, 0.75, 45, verified_rows_kernel=2, head_attention_kernel=1)
    assert captures_delta(total, None, read(9, 1.75, 45)) is total
    rows = [SimpleNamespace(name="ours-tree16-adaptive", batch_size=1, error=None,
                            graph_captures=total),
            SimpleNamespace(name="vllm-eagle3", batch_size=1, error=None, graph_captures=None)]
    table = format_captures_table(rows)
    assert "ours-tree16-adaptive" in table and "vllm-eagle3" not in table
    assert table.splitlines()[-1].split()[2:] == [
        "5", "0.75", "45", "head_attention_kernel", "1,", "verified_rows_kernel", "2"], table


def test_a_steps_acceptance_is_read_from_a_sample_of_its_requests():
    """The scheduler reads a step's acceptance from its first
    `MAX_OBSERVED_REQUESTS` decoding requests (about 2 us each, per step, on
    the H200's host: docs/results/batch_draft_length_h200_run10), the mix of
    requests with and without drafts as the scheduler ordered them."""
    from types import SimpleNamespace

    from vllm_specplug.integration.batch_schedule import MAX_OBSERVED_REQUESTS, _accepted_counts

    req_ids = [f"r{i}" for i in range(64)]
    spec = {r: [7] * 4 for r in req_ids[::2]}  # every other request drafted, accepting 2
    num_scheduled = {r: 5 if r in spec else 1 for r in req_ids}
    runner = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[1, 2, 3] if r in spec else [1] for r in req_ids])
    counts = _accepted_counts(spec, num_scheduled, runner)
    assert list(counts.values()) == [2, 0] * (MAX_OBSERVED_REQUESTS // 2)
    assert list(counts) == req_ids[:MAX_OBSERVED_REQUESTS]
    prefill = {**num_scheduled, "r1": 30}  # a prefill is no decode: left out
    assert list(_accepted_counts(spec, prefill, runner).values())[:3] == [2, 2, 0]


def test_the_policy_channel_carries_its_sums_and_a_reset_counts_from_zero(tmp_path):
    """The scheduler's channel to the server's stat logger
    (integration/policy_channel.py): the last values written, read whole;
    the logger adds what came since its last read, and a sum that went down
    (the engine's policy replaced) from zero again."""
    from types import SimpleNamespace

    from vllm_specplug.integration.policy_channel import PolicyChannelReader, PolicyChannelWriter
    from vllm_specplug.integration.stat_logger import SpecplugStatLogger

    path = tmp_path / "channel"
    assert PolicyChannelReader(path).read() is None  # no engine writes there
    writer = PolicyChannelWriter(path)
    stats = SimpleNamespace(num_steps=7, expected_tokens=12.5, realised_tokens=14.0,
                            num_requests=5)
    writer.write(stats, 15)
    assert PolicyChannelReader(path).read() == {
        "num_steps": 7, "current": 15, "expected_tokens": 12.5, "realised_tokens": 14.0,
        "num_requests": 5}
    stat_logger = object.__new__(SpecplugStatLogger)  # its channel reading alone
    added = {}
    stat_logger.policy_sums = {field: SimpleNamespace(inc=lambda x, f=field: added.setdefault(
        f, []).append(x)) for field in ("expected_tokens", "realised_tokens", "num_requests")}
    stat_logger.policy_length = SimpleNamespace(
        set=lambda x: added.setdefault("length", []).append(x))
    stat_logger.channel = PolicyChannelReader(path)
    stat_logger.last_sums = dict.fromkeys(stat_logger.policy_sums, 0.0)
    stat_logger._read_policy()
    writer.write(SimpleNamespace(num_steps=9, expected_tokens=20.0, realised_tokens=21.0,
                                 num_requests=8), 15)
    stat_logger._read_policy()
    writer.write(SimpleNamespace(num_steps=1, expected_tokens=3.0, realised_tokens=4.0,
                                 num_requests=1), 8)  # a new policy
    stat_logger._read_policy()
    assert added["expected_tokens"] == [12.5, 7.5, 3.0]
    assert added["num_requests"] == [5, 3, 1] and added["length"] == [15, 15, 8]
    # an engine after it (the file put in place again): the logger maps the new one
    replaced = PolicyChannelWriter(path)
    replaced.write(SimpleNamespace(num_steps=2, expected_tokens=1.5, realised_tokens=2.0,
                                   num_requests=1), 4)
    assert stat_logger.channel.read()["current"] == 4
    writer.close()  # the engine before leaves the new engine's file in place
    assert stat_logger.channel.read()["current"] == 4
    replaced.close()
    assert not path.exists() and PolicyChannelReader(path).read() is None
    assert stat_logger.channel.read() is None  # the mapped file went with it


def test_a_step_verifying_a_length_the_policy_never_asked_is_observed_without_error():
    """The drafts of a step before this policy took over (a policy replaced
    mid-run, as tests/test_batch_draft_engine.py does) verify a length not
    among its candidates: neither its acceptance nor the requests' gains
    take it, and the step is no error (it once raised in the engine core)."""
    from types import SimpleNamespace

    from vllm_specplug.integration.batch_schedule import BatchDraftSchedule

    scheduler = SimpleNamespace(gains=RequestGains(), draft_length=BatchDraftLength((0, 4)),
                                _channel=None, _shapes_seen=set(), _drafted_before=None,
                                _maybe_log=lambda: None)
    spec = {"r0": [7] * 3}
    output = SimpleNamespace(scheduled_spec_decode_tokens=spec, num_scheduled_tokens={"r0": 4},
                             total_num_scheduled_tokens=4, finished_req_ids=(),
                             num_spec_tokens_to_schedule=4)
    runner = SimpleNamespace(req_id_to_index={"r0": 0}, sampled_token_ids=[[1, 2]])
    scheduler._first_at_shape = lambda k, out: True
    BatchDraftSchedule._observe(scheduler, output, runner, 0.01)
    assert scheduler.gains.sums == {} and scheduler.draft_length.acceptance.num_steps == 0
