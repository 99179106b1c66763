"""A probed pass's steps by kind, timed end to end (`bench offline --phases`).

On the H200 our heads' first step of a wave took twice vLLM's `eagle3`'s
(tiny model, batch 64: 48 against 24 ms, `waves` table of
docs/results/v2_tiny3_compile_h200), while the phases pass had our decode
step under vLLM's. A wave's requests reach the engine core over several
steps, so its prefills are spread over a few steps where running requests
decode beside them: for our heads such a step ingests the prefills eagerly
and drafts apart from the decodes' fused graph. Averaged over every step, the
phases table hides which kind of step costs what; this clock splits them:

| kind | the step |
| --- | --- |
| `first` | opens a wave: every request it schedules is new to the runner |
| `mixed` | prefills (new requests, or prompt chunks) beside decoding requests |
| `decode` | every request decodes (one token plus its drafts) |

A step's time is from its `execute_model` call to the next one's: under
async scheduling the host is held back by the GPU once the pipeline is full,
so over a wave these intervals add up to its wall time. The step before a
`first` one is not counted (its interval holds the idle time between two
waves), nor is the pass's last.

Each kind also gets its steps' host time by phase (bench/phases.py's
phases, per step of the kind): where a first step goes. On the H100 our
trees' first steps took 12.3-12.8 ms against vLLM `eagle3`'s 8.1 (SmolLM2,
batch 1, docs/results/smollm2_bestk_w16_h100_s68), and the phases averaged
over every step put about 2 ms of host time into each prefill ingest.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

STEP_KINDS = ("first", "mixed", "decode")


def step_kind(scheduler_output) -> str | None:
    """The kind of the step `scheduler_output` schedules (None: it schedules
    no tokens, or it is not a scheduler output)."""
    counts = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not counts:
        return None
    if opens_wave(scheduler_output):
        return "first"
    cached = scheduler_output.scheduled_cached_reqs.req_ids
    if scheduler_output.scheduled_new_reqs:
        return "mixed"
    drafts = scheduler_output.scheduled_spec_decode_tokens
    # a request decodes when it runs its last token and the drafts scheduled
    # for it; more tokens are a prompt's chunk
    if any(counts[req_id] > 1 + len(drafts.get(req_id, ())) for req_id in cached):
        return "mixed"
    return "decode"


def opens_wave(scheduler_output) -> bool:
    """Whether a step schedules only requests new to the runner (a wave's
    first: the interval before it holds the idle time between waves)."""
    return not scheduler_output.scheduled_cached_reqs.req_ids


@dataclass
class StepClock:
    """Seconds and steps per kind, from the start of one step to the next's;
    and the host seconds of each probed phase (bench/phases.py) in steps of
    each kind, over every step of that kind seen (`num_seen`)."""
    seconds: dict = field(default_factory=lambda: defaultdict(float))
    num_steps: dict = field(default_factory=lambda: defaultdict(int))
    num_seen: dict = field(default_factory=lambda: defaultdict(int))
    phase_seconds: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    open_kind: str | None = None  # the step whose interval is running
    opened: float = 0.0

    def step(self, kind: str | None, now: float) -> None:
        """A step of `kind` starts at `now` (seconds); None: not a step."""
        if kind is None:
            return
        if self.open_kind is not None and kind != "first":
            self.seconds[self.open_kind] += now - self.opened
            self.num_steps[self.open_kind] += 1
        self.open_kind, self.opened = kind, now
        self.num_seen[kind] += 1

    def add(self, phase: str, seconds: float) -> None:
        """A call of `phase` took `seconds` of host time in the open step."""
        if self.open_kind is not None:
            self.phase_seconds[self.open_kind][phase] += seconds

    def summary(self) -> dict:
        """{kind: {"num_steps", "wall_ms" (per step), "phases": {phase: host
        ms per step of that kind}}} for the kinds seen."""
        return {kind: {"num_steps": self.num_steps[kind],
                       "wall_ms": 1e3 * self.seconds[kind] / self.num_steps[kind],
                       "phases": {phase: 1e3 * seconds / self.num_seen[kind]
                                  for phase, seconds in self.phase_seconds[kind].items()}}
                for kind in STEP_KINDS if self.num_steps[kind]}


def step_kind_cells(step_kinds: dict) -> str:
    """'steps  ms' per kind, in STEP_KINDS order ('-' for a kind not seen)."""
    cells = []
    for kind in STEP_KINDS:
        found = step_kinds.get(kind)
        cells.append(f"{'-':>13}{'-':>7}" if found is None else
                     f"{found['num_steps']:>13}{found['wall_ms']:>7.2f}")
    return "".join(cells)
