"""Replay a batch policy's trace through its step times (`StepTimes`,
`adaptive/step_times.py`; issue 27): what each measured step was priced at
before it was taken, and the host's speed the times were read at, with the
code as it is or with its constants changed (`--set NAME=VALUE`). No engine:
the steps an engine took, in the order it took them, from the trace the
policy writes at DEBUG (`vllm_specplug.policy_trace`; the logging config
`benchmarks/logging/policy_trace.json`, docs/proposers.md).

    .venv/bin/python benchmarks/policy_replay.py docs/results/batch_draft_length_cpu_run18/policy_trace.log
    .venv/bin/python benchmarks/policy_replay.py TRACE --set HOST_WEIGHT=0.0

Open loop: the lengths are those the engine's policy chose; a change of the
step times changes the prices, not the steps. With the code that wrote the
trace and nothing set, the replay gives the trace's own prices and host
speeds: it says whether it did (`faithful`). Prints the host's speed along
the trace and, per length, for the steps priced beforehand: taken over
expected (their sums), the median ratio and the mean |log ratio|, apart for
the length the policy ran and the lengths it tried; and for the tries, the
tried length's price over the current length's against its time over the
current length's steps beside it (what a choice between them rests on);
`--json` writes it.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm_specplug.adaptive.step_times as step_times  # noqa: E402

LINE = re.compile(r"measured k=(\d+) batch=(\d+) ms=([\d.]+) expected_ms=(-|[\d.]+) "
                  r"host=([\d.]+) current=(\d+)")
# the trace's rounding: ms to 2 decimals, the host to 3
HOST_TOLERANCE, PRICE_TOLERANCE = 1.5e-3, 0.02
BESIDE = 16  # trace steps either side of a try whose current-length steps it is read against


@dataclass
class TraceStep:
    k: int
    batch_size: int
    ms: float
    expected_ms: float | None  # as the engine's policy priced it
    host: float                # the host's speed then
    current: int               # the length the policy ran


def parse_trace(path: Path) -> list[TraceStep]:
    """The trace's measured steps, in order (other lines are skipped)."""
    steps = []
    for line in path.read_text().splitlines():
        m = LINE.search(line)
        if m:
            steps.append(TraceStep(int(m[1]), int(m[2]), float(m[3]),
                                   None if m[4] == "-" else float(m[4]), float(m[5]), int(m[6])))
    if not steps:
        raise ValueError(f"{path}: no 'measured k=...' lines: record one with the logging "
                         "config benchmarks/logging/policy_trace.json")
    return steps


def replay(steps: list[TraceStep]) -> dict:
    """Each step priced before it is added, as `BatchDraftLength.measured`
    does: (ran it, k, expected ms, taken ms) per priced step, the host's
    speed before each step, and whether both equal the trace's."""
    times, priced, hosts, faithful, relative = step_times.StepTimes(), [], [], True, []
    for i, step in enumerate(steps):
        expected = times.estimate(step.k, step.batch_size, step.current)
        if step.k != step.current and expected is not None:
            # a try: its price over the current length's, against its time
            # over the current length's steps beside it
            anchor = times.estimate(step.current, step.batch_size, step.current)
            beside = _beside(steps, i)
            if anchor is not None and beside is not None:
                relative.append((step.k, math.log((expected[0] / anchor[0]) / (step.ms / beside))))
        faithful &= abs(times.host - step.host) <= HOST_TOLERANCE
        faithful &= (expected is None) == (step.expected_ms is None) and (
            expected is None or abs(1e3 * expected[0] - step.expected_ms)
            <= PRICE_TOLERANCE * step.expected_ms)
        if expected is not None:
            priced.append((step.k == step.current, step.k, 1e3 * expected[0], step.ms))
        hosts.append(times.host)
        times.add(step.k, step.batch_size, step.ms / 1e3, follow_host=step.k == step.current)
    return {"priced": priced, "hosts": hosts, "faithful": bool(faithful), "relative": relative}


def _beside(steps: list[TraceStep], i: int) -> float | None:
    """The median ms of the current length's steps within `BESIDE` steps of
    step i at its batch size's bucket (None without any): what one step
    takes, as the try's one step is read. Their mean (before 2026-12-05)
    put the CPU's stalls (one step in five or six, 1.5-4x) on the current
    side only, so a try that cost the same read about 1.25x dear at the
    median (runs 21 and 23 read 1.37-1.44x; the median makes it 1.0-1.4x,
    docs/results/batch_draft_length_cpu_run23)."""
    step, bucket = steps[i], step_times.batch_bucket(steps[i].batch_size)
    near = [s.ms for s in steps[max(i - BESIDE, 0):i + BESIDE + 1]
            if s.k == step.current == s.current
            and step_times.batch_bucket(s.batch_size) == bucket]
    return float(np.median(near)) if near else None


def pricing(priced: list[tuple]) -> dict | None:
    """Taken over expected (sums), median ratio, mean |log ratio|."""
    if not priced:
        return None
    logs = [math.log(taken / expected) for *_, expected, taken in priced]
    return {"steps": len(priced),
            "taken_over_expected": round(sum(p[3] for p in priced) / sum(p[2] for p in priced), 3),
            "median_ratio": round(math.exp(float(np.median(logs))), 3),
            "mean_abs_log": round(float(np.mean(np.abs(logs))), 3)}


def summarise(result: dict) -> dict:
    hosts, priced = result["hosts"], result["priced"]
    every = max(len(hosts) // 10, 1)
    tried, relative = {}, {}
    for p in priced:
        if not p[0]:
            tried.setdefault(p[1], []).append(p)
    for k, log in result["relative"]:
        relative.setdefault(k, []).append(log)
    return {"faithful": result["faithful"], "steps": len(hosts),
            "host_path": [round(h, 3) for h in hosts[::every]] + [round(hosts[-1], 3)],
            "ran": pricing([p for p in priced if p[0]]),
            "tried": {k: pricing(tried[k]) for k in sorted(tried)},
            "tried_relative": {k: _relative(relative[k]) for k in sorted(relative)}}


def _relative(logs: list[float]) -> dict:
    """How a tried length's price over the current one's compared with its
    time over the current length's steps beside it: the median and mean
    ratio (over 1: priced dear against the length the policy runs)."""
    return {"steps": len(logs), "median": round(math.exp(float(np.median(logs))), 3),
            "mean_abs_log": round(float(np.mean(np.abs(logs))), 3)}


@contextmanager
def constants_set(assignments: list[str]):
    """`NAME=VALUE` for constants of step_times.py (their own type), put
    back afterwards (a caller in the same process, a test, sees the code's)."""
    saved = {}
    try:
        for assignment in assignments:
            name, _, value = assignment.partition("=")
            if not hasattr(step_times, name) or not name.isupper():
                raise SystemExit(f"--set {assignment}: step_times.py has no constant {name!r}")
            saved.setdefault(name, getattr(step_times, name))
            setattr(step_times, name, type(saved[name])(value))
        yield
    finally:
        for name, value in saved.items():
            setattr(step_times, name, value)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with constants_set(args.set):
        summary = {"set": args.set, **summarise(replay(parse_trace(args.trace)))}
    print(f"{args.trace}: {summary['steps']} steps, replay faithful to the trace: "
          f"{'yes' if summary['faithful'] else 'no'} (set: {', '.join(args.set) or 'nothing'})")
    print("host speed along the trace: " + " ".join(f"{h:.2f}" for h in summary["host_path"]))
    for label, value in [("ran", summary["ran"])] + [(f"tried k={k}", v)
                                                     for k, v in summary["tried"].items()]:
        print(f"  {label:<10} " + ("-" if value is None else
                                   "  ".join(f"{key} {v}" for key, v in value.items())))
    print("tried lengths priced against the current one, over their time against its steps "
          f"within {BESIDE} beside them:")
    for k, value in summary["tried_relative"].items():
        print(f"  k={k:<8} " + "  ".join(f"{key} {v}" for key, v in value.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
