"""Host time per step of the batch draft-length policy (issue 27), in the
engine core's scheduler: what `SpecplugBatchDraftTree*Scheduler` adds to
every step besides vLLM's own scheduling.

Each simulated step does what the scheduler does per step
(integration/batch_schedule.py): choose the length, take the step's
accepted counts and a tree's accepted paths' ranks, its wall time and its
settled time, and hand its counters to the workers (pickled, as they cross
to the workers' processes). Batches of 1, 16 and 64 requests (the larger
ones drifting by a few requests, as a batch does), lengths 0-15 (the
16-node tree's candidates). Prints the minimum and median over repeats of
the mean microseconds per step, and the size of each step's pickled
counters.

    .venv/bin/python benchmarks/bench_policy_host.py [--steps 300] [--repeats 7]
"""
import argparse
import pickle
import random
import time

import numpy as np

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates

NUM_NODES = 16


class SimulatedSteps:
    """One policy fed made-up steps: acceptance up to 5 drafts, a step's
    time growing with its drafts, ranks rising along each path."""

    def __init__(self, seed: int = 0) -> None:
        self.policy = BatchDraftLength(draft_length_candidates(NUM_NODES - 1))
        self.rng, self.np_rng = random.Random(seed), np.random.default_rng(seed)
        self.counters_bytes = 0

    def step(self, batch_size: int) -> None:
        policy, rng = self.policy, self.rng
        k = policy.choose(batch_size)
        policy.verified(k, [rng.randint(0, min(k, 5)) for _ in range(batch_size)])
        if k > 0:
            ranks = self.np_rng.integers(0, NUM_NODES, size=(batch_size, NUM_NODES - 1))
            policy.verified_within(k, np.sort(ranks, axis=1).astype(np.int32))
        seconds = 0.002 + 1e-4 * k + 1e-4 * rng.random()
        policy.stepped("decode", seconds)
        policy.measured(k, batch_size, seconds)
        sent = pickle.dumps(policy.counters())
        pickle.loads(sent)
        self.counters_bytes = len(sent)


def per_step_us(batch_size: int, warm_steps: int, steps: int, repeats: int):
    """(min, median) over `repeats` of the mean microseconds per step, after
    `warm_steps` steps that fill the policy's windows; the last counters' size."""
    sim = SimulatedSteps()

    def size(i: int) -> int:
        return batch_size if batch_size == 1 else batch_size - i % 4

    for i in range(warm_steps):
        sim.step(size(i))
    means = []
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(steps):
            sim.step(size(i))
        means.append((time.perf_counter() - started) / steps * 1e6)
    means.sort()
    return means[0], means[len(means) // 2], sim.counters_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warm-steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'batch':>5s} {'us/step min':>12s} {'median':>8s} {'counters bytes':>15s}")
    for batch_size in (1, 16, 64):
        low, median, size = per_step_us(batch_size, args.warm_steps, args.steps, args.repeats)
        print(f"{batch_size:5d} {low:12.0f} {median:8.0f} {size:15d}")


if __name__ == "__main__":
    main()
