"""Host time per step of the batch draft-length policy (issue 27), in the
engine core's scheduler: what `SpecplugBatchDraftTree*Scheduler` adds to
every step besides vLLM's own scheduling.

Each simulated step runs the scheduler's own code
(integration/batch_schedule.py) over a stand-in for vLLM's scheduler: the
policy chooses the length (vLLM's lookup), its counters go on the
scheduler output (pickled, as they cross to the workers' processes), and
the step's output is observed: accepted counts, a tree's accepted paths'
ranks on one step in 4 (as the head records them; 32 once settled), its
wall time. Batches of 1, 16 and 64 requests (the larger ones drifting by a
few requests, as a batch does), lengths 0-15 (the 16-node tree's
candidates), a step's time growing with its drafts so that 15 is best.
Prints the minimum and median over repeats of the mean microseconds per
step (the whole simulated step: the stand-in's own work, the pickling), the
policy's own host time a step (what `bench offline`'s `policy us/step`
reports), the share of steps whose output it read, and the counters' size.

    .venv/bin/python benchmarks/bench_policy_host.py [--steps 300] [--repeats 7]
"""
import argparse
import pickle
import random
import time
from types import SimpleNamespace

import numpy as np

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates
from vllm_specplug.integration.batch_schedule import (BATCH_POLICY_ATTR, PATH_RANKS_ATTR,
                                                      BatchDraftSchedule)

NUM_NODES = 16
PATHS_EVERY = 4  # integration/v2/path_ranks.RECORD_EVERY


class _VllmScheduler:
    """What the mixin calls of vLLM's scheduler: a pure decode step of the
    batch at the length the lookup gives, and no requests finishing."""

    def __init__(self) -> None:
        self.batch_size = 1

    def schedule(self):
        k = self.dynamic_sd_lookup[self.batch_size]
        req_ids = [f"r{i}" for i in range(self.batch_size)]
        return SimpleNamespace(
            num_spec_tokens_to_schedule=k, total_num_scheduled_tokens=len(req_ids) * (1 + k),
            scheduled_spec_decode_tokens={r: [7] * k for r in req_ids} if k else {},
            num_scheduled_tokens={r: 1 + k for r in req_ids})

    def update_from_output(self, scheduler_output, model_runner_output):
        return {}

    def has_unfinished_requests(self) -> bool:
        return True


class SimulatedScheduler(BatchDraftSchedule, _VllmScheduler):
    def __init__(self, seed: int = 0) -> None:  # the mixin's state, without a vLLM config
        _VllmScheduler.__init__(self)
        self.draft_length = self.dynamic_sd_lookup = BatchDraftLength(
            draft_length_candidates(NUM_NODES - 1), chains=False)
        self._last_output_at = self._busy_since = None
        self._last_log, self._shapes_seen, self._channel = time.monotonic(), set(), None
        self._drafted_before = self._drafted_two_before = None
        self.rng, self.np_rng = random.Random(seed), np.random.default_rng(seed)
        self.num_steps, self.counters_bytes = 0, 0

    def step(self, batch_size: int) -> None:
        self.batch_size = batch_size
        output = self.schedule()
        sent = pickle.dumps(getattr(output, BATCH_POLICY_ATTR))
        pickle.loads(sent)
        self.counters_bytes = len(sent)
        k = output.num_spec_tokens_to_schedule
        runner = SimpleNamespace(
            req_id_to_index={r: i for i, r in enumerate(output.num_scheduled_tokens)},
            sampled_token_ids=[[1] * (1 + self.rng.randint(0, min(k, 5)))
                               for _ in range(batch_size)])
        every = PATHS_EVERY * getattr(self.draft_length, "sample_every", 1)  # 1 before it
        if k > 0 and self.num_steps % every == 0:
            ranks = self.np_rng.integers(0, NUM_NODES, size=(batch_size, NUM_NODES - 1))
            setattr(runner, PATH_RANKS_ATTR, (k, np.sort(ranks, axis=1).astype(np.int32)))
        self.num_steps += 1
        self.update_from_output(output, runner)
        # the step's wall time, as the next output's interval reads it
        self._last_output_at -= 0.002 + 1e-5 * k + 1e-4 * self.rng.random()


def per_step_us(batch_size: int, warm_steps: int, steps: int, repeats: int):
    """(min, median) over `repeats` of the mean microseconds per step, after
    `warm_steps` steps that fill the policy's windows; the share of steps
    read; the last counters' size."""
    sim = SimulatedScheduler()

    def size(i: int) -> int:
        return batch_size if batch_size == 1 else batch_size - i % 4

    for i in range(warm_steps):
        sim.step(size(i))
    means, read_before = [], sim.draft_length.acceptance.num_steps
    host_before = sim.draft_length.stats.host_seconds
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(steps):
            sim.step(size(i))
        means.append((time.perf_counter() - started) / steps * 1e6)
    means.sort()
    num_steps = steps * repeats
    read = (sim.draft_length.acceptance.num_steps - read_before) / num_steps
    policy = (sim.draft_length.stats.host_seconds - host_before) / num_steps * 1e6
    return means[0], means[len(means) // 2], policy, read, sim.counters_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warm-steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'batch':>5s} {'us/step min':>12s} {'median':>8s} {'policy us':>10s} {'read':>6s} "
          f"{'counters bytes':>15s}")
    for batch_size in (1, 16, 64):
        low, median, policy, read, size = per_step_us(batch_size, args.warm_steps, args.steps,
                                                      args.repeats)
        print(f"{batch_size:5d} {low:12.0f} {median:8.0f} {policy:10.0f} {read:6.0%} "
              f"{size:15d}")


if __name__ == "__main__":
    main()
