"""Schedulers that choose one draft length per step for the whole batch
(adaptive/batch_draft_length.py), through vLLM's dynamic speculative decoding.

vLLM's `Scheduler.schedule` reads `self.dynamic_sd_lookup[num_reqs]` each step
(built from `num_speculative_tokens_per_batch_size`) and sends the result to
the workers as `num_spec_tokens_to_schedule`: every speculator, vLLM's and
ours, drafts that many tokens for the next step, and Model Runner V2 replays
the FULL graph of that query length. `BatchDraftSchedule` puts a
`BatchDraftLength` in the lookup's place and feeds it each step's output: the
accepted counts and the wall time between outputs. The table the config sets
(`capture_table`) only makes vLLM capture a graph family per candidate
length; its values are never read. Output is unchanged: verification is.
"""
from __future__ import annotations

import logging
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates
from vllm_specplug.adaptive.wave_focus import RequestGains
from vllm_specplug.integration.policy_channel import PolicyChannelWriter, channel_path
from vllm_specplug.integration.scheduler import (SpecplugTreeAsyncScheduler,
                                                 SpecplugTreeScheduler)
from vllm_specplug.proposers.head_graphs import padded_batch

logger = logging.getLogger("vllm_specplug.adaptive")

LOG_INTERVAL_S = 10.0
# the policy's counters on each SchedulerOutput (the workers keep the last:
# `BatchPolicyView`; `vllm-specplug bench` reads them through its worker
# extension, since the scheduler runs in the engine core's process)
BATCH_POLICY_ATTR = "specplug_batch_draft_length"
# on each SchedulerOutput: `BatchDraftLength.sample_every` (1, or more once
# the policy settled), by which a tree head records its paths that much rarer
SAMPLE_EVERY_ATTR = "specplug_sample_every"
# on a ModelRunnerOutput: (drafts per request, [n, N - 1] node ranks of the
# accepted paths) of a tree step before it (integration/v2/path_ranks.py)
PATH_RANKS_ATTR = "specplug_path_ranks"
# a step's acceptance is read from this many of its requests: a sample
# enough for the policy's means (it fades over about 200 requests), where
# reading every request cost the scheduler about 2 us each, a step
# (docs/results/batch_draft_length_h200_run10: 182 / 241 / 293 us of policy
# time a step at batch 1 / 16 / 64)
MAX_OBSERVED_REQUESTS = 16


def capture_table(candidates: tuple[int, ...], max_num_seqs: int) -> list[tuple[int, int, int]]:
    """A `num_speculative_tokens_per_batch_size` table whose values are the
    candidates (so vLLM captures decode graphs for each), one batch size
    each, the last to `max_num_seqs`. Candidates beyond `max_num_seqs` rows
    are dropped (`table_lengths` reads back which are left)."""
    lengths = sorted(candidates, reverse=True)[:max(1, max_num_seqs)]
    table = [(i + 1, i + 1, k) for i, k in enumerate(lengths[:-1])]
    return table + [(len(lengths), max(max_num_seqs, len(lengths)), lengths[-1])]


def batch_draft_scheduled(vllm_config) -> bool:
    """Whether the engine's scheduler is ours, one draft length per step."""
    cls = vllm_config.scheduler_config.scheduler_cls
    return cls is not None and issubclass(vllm_config.scheduler_config.get_scheduler_cls(),
                                          BatchDraftSchedule)


def table_lengths(table) -> tuple[int, ...]:
    return tuple(sorted({int(entry[2]) for entry in table}))


class BatchDraftSchedule:
    """Mixin for a vLLM `Scheduler`: `dynamic_sd_lookup` is a live
    `BatchDraftLength` over the lengths of the configured table."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        spec = self.vllm_config.speculative_config
        table = getattr(spec, "num_speculative_tokens_per_batch_size", None)
        lengths = (table_lengths(table) if table
                   else draft_length_candidates(self.num_spec_tokens))
        self.draft_length = BatchDraftLength(tuple(k for k in lengths
                                                   if k <= self.num_spec_tokens),
                                             chains=not _drafts_trees(spec))
        self.dynamic_sd_lookup = self.draft_length
        # each request's acceptance against the mean's: with adaptive_focus a
        # draining batch's length serves its slowest request (adaptive/wave_focus.py)
        # (None without it: no per-request work on the scheduler's hot path)
        self.gains = RequestGains() if _focus_wanted(spec) else None
        if self.gains is not None:
            self.draft_length.focus = self._wave_focus
        self._last_output_at: float | None = None
        self._busy_since: float | None = None  # the schedule that ended an idle spell
        self._last_log = time.monotonic()
        self._shapes_seen: set[tuple[int, int]] = set()
        self._drafted_before: int | None = None  # the last step's K (its drafts verify next)
        self._drafted_two_before: int | None = None  # the K of the step before that
        self._channel = _open_channel(self.vllm_config)  # to the server's /metrics

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        super().shutdown()

    def schedule(self, *args, **kwargs):
        called = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        started = time.perf_counter()
        if (self._last_output_at is None and self._busy_since is None
                and output.total_num_scheduled_tokens > 0):
            self._busy_since = called
        setattr(output, BATCH_POLICY_ATTR, self.draft_length.step_counters())
        setattr(output, SAMPLE_EVERY_ATTR, self.draft_length.sample_every)
        self.draft_length.stats.host_seconds += time.perf_counter() - started
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        now = time.perf_counter()
        seconds = None if self._last_output_at is None else now - self._last_output_at
        if seconds is None and self._busy_since is not None:
            # the first output after idling: its schedule, the requests' first
            # (prefill) step, and whatever a batch's start costs besides
            self.draft_length.stepped("first", now - self._busy_since)
            self._busy_since = None
        self._last_output_at = now
        self._observe(scheduler_output, model_runner_output, seconds)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not self.has_unfinished_requests():
            # idle until the next request: its first step's interval would
            # hold the wait
            self._last_output_at = None
        return outputs

    def _observe(self, scheduler_output, model_runner_output, seconds: float | None) -> None:
        """The step's accepted counts count for the K its drafts were asked
        for (the step before's), every decoding request's: one that drafted
        nothing at that K (n-gram and suffix often find nothing) gained no
        drafts. Its time counts for K when it was a pure decode step that
        verified and drafted the same K after a step that did too (settled:
        the first step at a new length is slower, batch_draft_length.py),
        whoever drafted. Once the policy settled, only one step in its
        `sample_every` is read so (`BatchDraftLength.samples`); every step's
        kind and time, and the tree paths that arrive, are kept."""
        started = time.perf_counter()
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_scheduled = scheduler_output.num_scheduled_tokens
        num_reqs = len(num_scheduled)
        if num_reqs == 0:
            return
        # the K asked of the drafts verified now, and of those drafted now
        verified_k, drafted_k = self._drafted_before, scheduler_output.num_spec_tokens_to_schedule
        if verified_k is None:  # the first step seen
            verified_k = self._drafted_two_before = max((len(ids) for ids in spec.values()),
                                                        default=0)
        settled = self._drafted_two_before == verified_k == drafted_k
        self._drafted_two_before, self._drafted_before = verified_k, drafted_k
        sampled = self.draft_length.samples(verified_k, drafted_k)
        if self.gains is not None:
            self.gains.forget(scheduler_output.finished_req_ids)
        if sampled:
            counts = _accepted_counts(spec, num_scheduled, model_runner_output)
            if self.gains is not None and verified_k in self.draft_length.lengths:
                # (not at a length it never asked: the drafts of a step
                # before this policy took over)
                expected = self.draft_length.expected_tokens(verified_k) - 1.0
                for req_id, count in counts.items():
                    self.gains.observed(req_id, count, expected)
            self.draft_length.verified(verified_k, list(counts.values()))
        path_ranks = getattr(model_runner_output, PATH_RANKS_ATTR, None)
        if path_ranks is not None:  # a tree step's paths: every smaller tree's acceptance
            self.draft_length.verified_within(*path_ranks)
        pure_decode = scheduler_output.total_num_scheduled_tokens == num_reqs + sum(
            map(len, spec.values()))  # (a generator over 256 requests took 10 us a step)
        if seconds is not None:
            self.draft_length.stepped(("mixed" if not pure_decode else "decode"
                                       if settled else "switch"), seconds)
        if sampled:
            if seconds is not None and pure_decode and settled:
                if self._first_at_shape(verified_k, scheduler_output):
                    self.draft_length.stats.num_first_at_shape += 1
                else:
                    self.draft_length.measured(verified_k, num_reqs, seconds)
            self._maybe_log()
            if self._channel is not None:
                self._channel.write(self.draft_length.stats, self.draft_length.current)
        self.draft_length.stats.host_seconds += time.perf_counter() - started

    def _wave_focus(self) -> float | None:
        """While nothing waits, the focus ratio of the running request with
        the most steps left (`RequestGains.focus`); else None."""
        num_running, num_waiting = self.get_request_counts()
        if num_waiting or not num_running:
            return None
        expected = self.draft_length.expected_tokens(self.draft_length.current)
        return self.gains.focus(((r.request_id, r.max_tokens - r.num_output_tokens)
                                 for r in self.running), expected)

    def _first_at_shape(self, k: int, scheduler_output) -> bool:
        """Whether this is the first step at its (K, padded batch): the head
        of specplug_eagle3/specplug_mtp captures its step graph for such a
        shape on first use (proposers/head_graphs.py), and that step's time
        is the capture's (200-450 ms on the H100, where the step replayed
        took 2-30). For the other methods it costs one sample."""
        shape = (k, padded_batch(len(scheduler_output.num_scheduled_tokens)))
        if shape in self._shapes_seen:
            return False
        self._shapes_seen.add(shape)
        return True

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            return
        self._last_log = now
        d = self.draft_length.as_dict()
        logger.info("vllm-specplug batch draft length: K=%s now, chosen %s, explored %d of %d "
                    "steps, tokens/request expected %s vs realised %s", d["current"],
                    d["chosen"], d["num_explored"], d["num_steps"],
                    _fmt(d["expected_tokens_per_request"]),
                    _fmt(d["realised_tokens_per_request"]))


def _open_channel(vllm_config) -> PolicyChannelWriter | None:
    """The policy's channel to the server's stat logger; None (and a
    warning: the metrics lack it, the engine runs on) where its file cannot
    be written."""
    path = channel_path(vllm_config, vllm_config.parallel_config.data_parallel_rank)
    try:
        return PolicyChannelWriter(path)
    except OSError as error:
        logger.warning("vllm-specplug: the batch policy's expected tokens will not reach "
                       "/metrics: cannot write %s (%s)", path, error)
        return None


def _focus_wanted(spec) -> bool:
    """Whether the selection asks for `adaptive_focus`."""
    from vllm_specplug.integration.config import selection_of

    selection = selection_of(spec)
    return selection is not None and selection.adaptive_focus


def _drafts_trees(spec) -> bool:
    """Whether the method drafts trees (a head with topk > 1), whose
    smaller trees are not prefixes of the larger."""
    from vllm_specplug.integration.config import selection_of

    selection = selection_of(spec)
    return selection is not None and int(selection.options.get("topk", 1) or 1) > 1


class BatchPolicyView:
    """A drafter's or speculator's copy of the batch policy's counters, as of
    the last step it was handed (None: no batch policy scheduled it); the
    step times only come when the policy took them again
    (`BatchDraftLength.counters`), so each step's counters are merged in."""

    batch_policy: dict | None = None
    sample_every = 1  # the policy's `sample_every` as of the last step
    _merged: dict | None = None  # the counters merged last (handed out again until taken)

    def observe_schedule(self, scheduler_output) -> None:
        counters = getattr(scheduler_output, BATCH_POLICY_ATTR, None)
        if counters is not None and counters is not self._merged:
            self._merged = counters
            self.batch_policy = {**(self.batch_policy or {}), **counters}
        self.sample_every = getattr(scheduler_output, SAMPLE_EVERY_ATTR, 1)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _accepted_counts(spec: dict, num_scheduled: dict, model_runner_output) -> dict[str, int]:
    """{req_id: accepted drafts} of the step's first `MAX_OBSERVED_REQUESTS`
    decoding requests: its sampled tokens - 1 for one that had drafts, 0 for
    one that decoded without (the order is the scheduler's, not the
    acceptance's)."""
    index = model_runner_output.req_id_to_index
    sampled = model_runner_output.sampled_token_ids
    counts = {}
    for req_id, n in num_scheduled.items():
        ids = spec.get(req_id)
        if ids:
            i = index.get(req_id)
            if i is not None and i < len(sampled) and len(sampled[i]):
                counts[req_id] = min(len(sampled[i]) - 1, len(ids))
        elif n == 1:
            counts[req_id] = 0
        if len(counts) == MAX_OBSERVED_REQUESTS:
            break
    return counts


class SpecplugBatchDraftScheduler(BatchDraftSchedule, Scheduler):
    """vLLM's sync `Scheduler`, one draft length per step."""


class SpecplugBatchDraftAsyncScheduler(BatchDraftSchedule, AsyncScheduler):
    """vLLM's `AsyncScheduler`, one draft length per step (Model Runner V2)."""


class SpecplugBatchDraftTreeScheduler(BatchDraftSchedule, SpecplugTreeScheduler):
    """Grammar-aware trees (scheduler.SpecplugTreeScheduler), one tree size per step."""


class SpecplugBatchDraftTreeAsyncScheduler(BatchDraftSchedule, SpecplugTreeAsyncScheduler):
    """Grammar-aware trees under async scheduling (scheduler.SpecplugTreeAsyncScheduler:
    its deferred step's overrides included; with `TreeGrammarScheduler` and
    `AsyncScheduler` alone, a constrained tree was read as a list), one tree
    size per step."""
