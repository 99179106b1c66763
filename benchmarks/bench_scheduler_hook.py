"""Speculative slots scheduled for variable-length drafts, per scheduler class.

Runs vLLM's `Scheduler` (sync), `AsyncScheduler` and our `SpecplugAsyncScheduler`
through the engine-core loop with a scripted worker (vllm_specplug/testing/
scheduler_sim.py) on the same requests and draft-length rules, and prints the
speculative slots each scheduled, how many had no draft token behind them
(compute thrown away), draft tokens truncated, and tokens accepted.

    .venv/bin/python benchmarks/bench_scheduler_hook.py [--k 4] [--num-requests 6]
"""
import argparse

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_specplug.integration.scheduler import SpecplugAsyncScheduler
from vllm_specplug.models.build import build_model
from vllm_specplug.testing import scheduler_sim as sim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    k = args.k
    path = str(build_model("tiny"))
    prompts = [[5 + i, 6, 7, 8 + i] * (i + 1) for i in range(args.num_requests)]
    rules = {"stable (req % (K+1))": lambda r, s: r % (k + 1),
             "drifting ((req + step//3) % (K+1))": lambda r, s: (r + s // 3) % (k + 1)}
    classes = [(Scheduler, False), (AsyncScheduler, True), (SpecplugAsyncScheduler, True)]
    print(f"{'draft lengths':36s} {'scheduler':24s} {'slots':>6s} {'empty':>6s} "
          f"{'trunc':>6s} {'accepted':>8s}")
    for name, rule in rules.items():
        for cls, async_scheduling in classes:
            scheduler = sim.make_scheduler(cls, path, async_scheduling=async_scheduling,
                                           num_speculative_tokens=k)
            stats = sim.run(scheduler, prompts, args.max_tokens, rule)
            print(f"{name:36s} {cls.__name__:24s} {stats.num_spec_slots:6d} "
                  f"{stats.num_empty_slots:6d} {stats.num_truncated:6d} "
                  f"{stats.num_accepted:8d}")


if __name__ == "__main__":
    main()
