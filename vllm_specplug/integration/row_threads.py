"""xgrammar's tree walks of a step's verification rows, on several host
threads (`grammar_row_threads`).

Under structured outputs every draft node of a constrained request gets the
grammar's bitmask in its own path's state (grammar_trees.py). xgrammar
walks one request's tree in C++ (`GrammarMatcher.traverse_draft_tree`) and
releases the GIL while it does. One thread per step walked every tree in
turn: on SmolLM2 under a JSON schema (H200, the GPU-built head) our
tree 16's worker spent 14.6 ms a step in the grammar at batch 64 (1088
rows), against 0.8 ms for vLLM's `eagle3` chain, whose rows the engine core
fills (docs/results/v2_schema_large_head_h200). Requests' grammars and
rows are disjoint, so their walks can run side by side; the bookkeeping
around each walk stays on the caller's thread (`plan_request_rows`, or the
whole step's at once: tree_walks.py). On
this 2-core CPU, 64 trees of 17 nodes (SmolLM2's vocabulary, its JSON
schema): 7.4 ms on one thread, 5.0 ms with the walks on two; more threads
than cores ran slower, and on benchmarks/bench_grammar_walk.py's random
trees two threads gave 0.9-1.2x. On the H200's host the same step took
12.66 ms on one thread and 5.81 ms on 8, and in the engine at batch 64
under the schema the worker's grammar phase went from 10.6 to 6.1 ms a
step, 1.19x [0.97-1.51] one thread's speed
(docs/results/v2_schema_threads_h200): "auto" is the default.

vLLM fills its own rows on threads past 128 requests without speculation
(`StructuredOutputManager.executor_for_fillmask`, at most half the CPUs or
8); "auto" takes the same number.
"""
from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Sequence

from vllm_specplug.integration.grammar_trees import NativeWalk
from vllm_specplug.proposers.eagle3 import AUTO_ROW_THREADS

# A step with fewer rows fills them on the calling thread: a task's hand-off
# costs tens of µs, a row 5-12 µs (xgrammar on the H200's host); vLLM
# threads its own fills past 128 requests
MIN_ROWS = 128
TASKS_PER_THREAD = 2  # smaller tasks even out trees of different costs


def num_row_threads(option: int | str) -> int:
    """Threads for `grammar_row_threads`: "auto" is vLLM's fill pool's
    size, at most half this process's CPUs or 8, at least 1."""
    if option != AUTO_ROW_THREADS:
        return int(option)
    try:
        num_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        num_cpus = os.cpu_count() or 1
    return max(1, min(num_cpus // 2, 8))


class RowThreads:
    """Runs a step's tree walks (`NativeWalk.run`, grammar_trees.py), on a
    pool once the step has `min_rows` rows (one thread: always on the
    caller's). Only xgrammar's C++ call runs there: the bookkeeping before
    and after each walk stays on the caller's thread, where it holds the
    GIL anyway. (Whole fills on threads, Python included, ran 0.5x of one
    thread on 8 threads of the H200's host: the threads queued for the
    GIL between their short C++ calls,
    docs/results/v2_grammar_smollm2_unmasked_h200.)"""

    def __init__(self, num_threads: int, min_rows: int = MIN_ROWS) -> None:
        self.num_threads = num_threads
        self.min_rows = min_rows
        self.pool = (concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="specplug-rows") if num_threads > 1 else None)

    def threaded(self, num_rows: Sequence[int]) -> bool:
        """Whether a step of requests with these rows goes to the pool."""
        return self.pool is not None and len(num_rows) > 1 and sum(num_rows) >= self.min_rows

    def fill(self, plan: Callable[[int], tuple[NativeWalk | None, Callable[[], int]]],
             num_rows: Sequence[int]) -> list[int]:
        """Each request's result: `plan(i)` lays out request i's rows
        (`plan_request_rows`: its walk, then the rest, which returns the
        result). On the pool, every plan first, the walks side by side,
        then the rests in order; else request after request (its rows
        still in the cache for the rest: 64 trees all planned, then walked,
        then finished took 8% longer on this CPU)."""
        if not self.threaded(num_rows):
            results = []
            for i in range(len(num_rows)):
                walk, finish = plan(i)
                if walk is not None:
                    walk.run()
                results.append(finish())
            return results
        plans = [plan(i) for i in range(len(num_rows))]
        self.run([walk and walk.run for walk, _ in plans], num_rows)
        return [finish() for _, finish in plans]

    def run(self, jobs: Sequence[Callable[[], None] | None], num_rows: Sequence[int]) -> None:
        """Every job that is not None, `num_rows[i]` being job i's rows (what
        it costs), on the pool when `threaded`. A job touches only its own
        request's grammar and rows. An error is raised once every task has
        ended, so no thread still writes a row after it."""
        if not self.threaded(num_rows):
            for job in jobs:
                if job is not None:
                    job()
            return
        tasks = [self.pool.submit(_run, [jobs[i] for i in chunk])
                 for chunk in _chunks(num_rows, self.num_threads * TASKS_PER_THREAD)]
        concurrent.futures.wait(tasks)
        for task in tasks:
            task.result()  # raises a job's error

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _run(jobs: list[Callable[[], None] | None]) -> None:
    for job in jobs:
        if job is not None:
            job()


def _chunks(num_rows: Sequence[int], num_chunks: int) -> list[range]:
    """Contiguous ranges of requests, each with about the same rows."""
    total = sum(num_rows)
    chunks, start, filled = [], 0, 0
    for i, rows in enumerate(num_rows):
        filled += rows
        if filled * num_chunks >= total * (len(chunks) + 1) and i + 1 < len(num_rows):
            chunks.append(range(start, i + 1))
            start = i + 1
    chunks.append(range(start, len(num_rows)))
    return chunks
