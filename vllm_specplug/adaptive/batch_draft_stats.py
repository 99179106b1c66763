"""What the batch draft-length policy (batch_draft_length.py) counts and
reports: per-length bookkeeping, its step counters, and the keys `bench`
reads of them (bench/offline.py, bench/report.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

# each pure decode step the policy measured (DEBUG): its length, batch, time,
# what the policy expected of it and the host's speed then. The windows
# (`step_windows`) keep normalised times only; run 17 on CPU priced K=0 at 65
# ms where it took 123 (docs/results/batch_draft_length_cpu_run16), and only
# the steps in order can say when the two parted. Engine core processes log
# it to a file through vLLM's `VLLM_LOGGING_CONFIG_PATH` (docs/proposers.md).
trace = logging.getLogger("vllm_specplug.policy_trace")

# `counters` (read every step) takes the step times again after this many
# decode steps: a quantile per length and bucket is too dear for every step
STEP_MS_EVERY = 64
# counters that are a state as of now, not counts to difference
SNAPSHOT_KEYS = ("current", "expected_per_length", "step_ms", "step_windows", "host_speed")
# steps of each kind (decode, switch) before `switch_penalty` reads their means
MIN_KIND_STEPS = 8
# the kinds of step whose wall time `stepped` adds up (BatchDraftStats)
# ("first": from the schedule that ended an idle engine to its first output:
# the step that starts a batch of new requests, with their prefill)
STEP_KINDS = ("decode", "switch", "mixed", "first")


@dataclass
class LengthStats:
    """What is known about one candidate K besides its step times and
    acceptance (`LengthAcceptance`)."""
    last_measured: int = -1  # decode step at which its time was last observed
    num_chosen: int = 0  # steps it was chosen for (not explored)


@dataclass
class BatchDraftStats:
    num_steps: int = 0  # steps scheduled with a decision
    num_explored: int = 0
    num_measured: int = 0  # steps whose time counted
    num_stalled: int = 0  # steps whose time was dropped as a stall (StepTimes.add)
    num_first_at_shape: int = 0  # steps not timed: first at their shape (the scheduler's)
    num_path_steps: int = 0  # tree steps whose accepted paths taught the smaller sizes
    # weighings of a draining batch by its slowest request (wave_focus.py),
    # and their focus ratios summed
    num_focused: int = 0
    focus_ratio_sum: float = 0.0
    # every step's wall time between outputs, by kind (the scheduler's
    # `_observe`): pure decode steps that verified and drafted one length
    # after a step that did too (timed or not), those that changed length or
    # were the first after a change, steps with prefill tokens, and the
    # first step after the engine idled (from its schedule to its output); a
    # phase's time beyond their sum is spent idle
    decode_steps: int = 0
    decode_seconds: float = 0.0
    switch_steps: int = 0
    switch_seconds: float = 0.0
    mixed_steps: int = 0
    mixed_seconds: float = 0.0
    first_steps: int = 0
    first_seconds: float = 0.0
    # expected vs realised tokens per request of the steps verified at the
    # length it exploits (the requests the scheduler observes: at most
    # `MAX_OBSERVED_REQUESTS` a step, integration/batch_schedule.py)
    expected_tokens: float = 0.0
    realised_tokens: float = 0.0
    num_requests: int = 0
    # per length K, its pure decode steps that the policy had priced
    # beforehand: their wall time as taken, and what it expected of them
    # (`StepTimes.estimate` at the step's batch size, the host's speed as
    # then known), stalls included; the two part where the windows'
    # normalised times (`step_windows`) no longer say what a step costs
    priced_steps: dict = field(default_factory=dict)  # K -> steps
    priced_seconds: dict = field(default_factory=dict)  # K -> their seconds
    expected_seconds: dict = field(default_factory=dict)  # K -> the seconds expected
    # the scheduler's wall time in the policy: its lookups (`__getitem__`),
    # what it observes of each output, its counters (issue 26: host work per step)
    host_seconds: float = 0.0

    @staticmethod
    def trace_step(k: int, batch_size: int, seconds: float, expected, host: float,
                   current: int) -> None:
        """`trace` one measured step (`expected`: (seconds, error) or None)."""
        if trace.isEnabledFor(logging.DEBUG):
            trace.debug("measured k=%d batch=%d ms=%.2f expected_ms=%s host=%.3f current=%d",
                        k, batch_size, 1e3 * seconds,
                        "-" if expected is None else f"{1e3 * expected[0]:.2f}", host, current)

    def priced(self, k: int, seconds: float, expected: float) -> None:
        self.priced_steps[k] = self.priced_steps.get(k, 0) + 1
        self.priced_seconds[k] = self.priced_seconds.get(k, 0.0) + seconds
        self.expected_seconds[k] = self.expected_seconds.get(k, 0.0) + expected
