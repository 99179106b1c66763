"""A mixed online load: concurrency ramping up and back down (issue 27).

A fixed concurrency shows one point of the batch-size curve. A server sees
its load change: the adaptive controllers must follow it, and a static
setting tuned for one concurrency pays at the others. `run_ramp` sends
stages of `stages[i]` concurrent streaming clients, one after another (1, 2,
4, ... up to the peak and back: `ramp_stages`), each stage
`requests_per_client` requests per client, prompts taken in turn; the
speculation counters are read around the whole ramp. Servers take their
turns per repeat (server A, B, C, then A, B, C again), so slow drifts of the
machine fall on every server alike; `--repeats` >= 3 gives the spread.
"""
from __future__ import annotations

import time

from tqdm import tqdm

from vllm_specplug.bench.online import (OnlineRow, Server, compare_to_first, fill_row,
                                        read_counts, send_all)
from vllm_specplug.bench.prompts import BenchPrompt


def ramp_stages(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... high, ... 4 low, 2 low, low."""
    if low < 1 or high < low:
        raise ValueError(f"--ramp {low} {high}: expected 1 <= LOW <= HIGH")
    up, level = [], low
    while level < high:
        up.append(level)
        level *= 2
    up.append(high)
    return up + up[-2::-1]


def ramp_label(stages: list[int]) -> str:
    peak = max(stages)
    return f"ramp {stages[0]}-{peak}-{stages[-1]}"


def run_ramp(server: Server, prompts: list[BenchPrompt], stages: list[int],
             requests_per_client: int, max_tokens: int, temperature: float,
             timeout: float, progress, repeat: int = 0) -> OnlineRow:
    """One pass of the ramp against `server`: one row over all its stages."""
    requests = _stage_prompts(prompts, stages, requests_per_client)
    row = OnlineRow(server.name, max(stages), sum(map(len, requests)),
                    load=ramp_label(stages), repeat=repeat)
    before = read_counts(server)
    start = time.perf_counter()
    timings = []
    for level, stage in zip(stages, requests):
        timings += send_all(server, stage, level, max_tokens, temperature, timeout, progress)
    fill_row(row, timings, time.perf_counter() - start, read_counts(server) - before)
    return row


def _stage_prompts(prompts: list[BenchPrompt], stages: list[int],
                   requests_per_client: int) -> list[list[BenchPrompt]]:
    """Each stage's prompts, taken in turn from `prompts` (the same for every
    server and repeat, so outputs compare one to one)."""
    out, cursor = [], 0
    for level in stages:
        n = level * requests_per_client
        out.append([prompts[(cursor + i) % len(prompts)] for i in range(n)])
        cursor += n
    return out


def run_ramps(servers: list[Server], prompts: list[BenchPrompt], stages: list[int],
              requests_per_client: int, repeats: int, max_tokens: int,
              temperature: float = 0.0, timeout: float = 600,
              warmup_passes: int = 1) -> list[OnlineRow]:
    """`warmup_passes` unmeasured passes per server (a server compiles
    kernels and captures graphs the first time a shape comes: on the H200
    vLLM's engines and ours compiled Triton kernels on their first requests,
    docs/results/batch_draft_length_h200_run12), then `repeats` passes,
    servers interleaved within each; one row per (server, repeat), compared
    with the first server's of the same repeat."""
    per_pass = sum(stages) * requests_per_client
    rows = []
    total = (warmup_passes + repeats) * len(servers) * per_pass
    with tqdm(total=total, desc="bench ramp", unit="req") as progress:
        for server in servers:
            for _ in range(warmup_passes):
                progress.set_postfix_str(f"{server.name} warm-up")
                run_ramp(server, prompts, stages, requests_per_client, max_tokens,
                         temperature, timeout, progress)
        for repeat in range(repeats):
            for server in servers:
                progress.set_postfix_str(f"{server.name} repeat {repeat + 1}")
                rows.append(run_ramp(server, prompts, stages, requests_per_client,
                                     max_tokens, temperature, timeout, progress, repeat))
    compare_to_first(rows, servers[0].name, greedy=temperature == 0)
    return rows
