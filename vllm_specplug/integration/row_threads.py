"""A step's verification rows filled on several host threads
(`grammar_row_threads`).

Under structured outputs every draft node of a constrained request gets the
grammar's bitmask in its own path's state (grammar_trees.py). xgrammar
walks one request's tree in C++ (`GrammarMatcher.traverse_draft_tree`) and
releases the GIL while it does. One thread per step walked every tree in
turn: on SmolLM2 under a JSON schema (H200, the GPU-built head) our
tree 16's worker spent 14.6 ms a step in the grammar at batch 64 (1088
rows), against 0.8 ms for vLLM's `eagle3` chain, whose rows the engine core
fills (docs/results/v2_schema_large_head_h200). Requests' grammars and
rows are disjoint, so their walks can run side by side: on this 2-core
machine, 64 trees of 17 nodes took 5.6 ms on one thread and 3.3 ms over
four (5.7 ms of CPU time either way).

vLLM fills its own rows on threads the same way past 128 requests without
speculation (`StructuredOutputManager.executor_for_fillmask`, at most half
the CPUs or 8); "auto" takes the same number.
"""
from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from vllm_specplug.proposers.eagle3 import AUTO_ROW_THREADS

# A step with fewer rows fills them on the calling thread: a task's hand-off
# costs tens of µs, a row 5-12 µs (xgrammar on the H200's host); vLLM
# threads its own fills past 128 requests
MIN_ROWS = 128
TASKS_PER_THREAD = 2  # smaller tasks even out trees of different costs

Result = TypeVar("Result")


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
    """Runs one fill per request, on a pool once a step has `min_rows`
    rows (one thread: always on the caller's)."""

    def __init__(self, num_threads: int, min_rows: int = MIN_ROWS) -> None:
        self.num_threads = num_threads
        self.min_rows = min_rows
        self.pool = (concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="specplug-rows") if num_threads > 1 else None)

    def map(self, fill: Callable[[int], Result], num_rows: Sequence[int]) -> list[Result]:
        """[fill(i) for i in range(len(num_rows))], `num_rows[i]` being
        request i's rows (what its fill costs). Each fill must touch only
        its own request's grammar and rows. An error is raised once every
        task has ended, so no thread still writes a row after it."""
        if self.pool is None or sum(num_rows) < self.min_rows or len(num_rows) < 2:
            return [fill(i) for i in range(len(num_rows))]
        tasks = [self.pool.submit(_run, fill, chunk) for chunk in
                 _chunks(num_rows, self.num_threads * TASKS_PER_THREAD)]
        concurrent.futures.wait(tasks)
        return [result for task in tasks for result in task.result()]

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _run(fill: Callable[[int], Result], indices: range) -> list[Result]:
    return [fill(i) for i in indices]


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
