"""A mixed online load: concurrency ramping up and back down (issue 27).

A fixed concurrency shows one point of the batch-size curve. A server sees
its load change: the adaptive controllers must follow it, and a static
setting tuned for one concurrency pays at the others. `run_ramp` sends
stages of `stages[i]` concurrent streaming clients, one after another (1, 2,
4, ... up to the peak and back: `ramp_stages`), each stage
`requests_per_client` requests per client, prompts taken in turn; the
speculation counters are read around each stage, outside its time (a stage
ends when its last request does). Servers take their turns per repeat
(server A, B, C, then A, B, C again), so slow drifts of the machine fall on
every server alike; `--repeats` >= 3 gives the spread. Besides the pass as a
whole, each stage's tokens/s over the first server's and drafts per request
show where along the load a server gains or loses (`format_stage_tables`).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

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
    first = before = read_counts(server)
    timings, seconds = [], 0.0
    for level, stage in zip(stages, requests):
        start = time.perf_counter()
        done = send_all(server, stage, level, max_tokens, temperature, timeout, progress)
        elapsed = time.perf_counter() - start
        after = read_counts(server)
        row.stages.append(_stage_entry(level, elapsed, done, after - before))
        timings, seconds, before = timings + done, seconds + elapsed, after
    fill_row(row, timings, seconds, before - first)
    return row


def _stage_entry(level: int, seconds: float, timings, counts) -> dict:
    """One stage of a pass: its time, output tokens and speculation counts."""
    done = [t for t in timings if t.error is None]
    return {"concurrency": level, "seconds": seconds,
            "num_output_tokens": sum(t.num_tokens for t in done),
            "num_failed": len(timings) - len(done), "num_drafts": counts.num_drafts,
            "num_draft_tokens": counts.num_draft_tokens,
            "num_accepted_tokens": counts.num_accepted_tokens}


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


def stage_labels(stages: list[int]) -> list[str]:
    """A stage's concurrency; "v" before it on the way down (`ramp_stages`)."""
    peak = stages.index(max(stages))
    return [f"{'v' if i > peak else ''}{level}" for i, level in enumerate(stages)]


def stage_speedups(rows: list[OnlineRow]) -> dict[str, list[list[float]]]:
    """{server: per stage, its tokens/s over the first server's in each
    repeat}; a stage with a failed request, or none, has no ratio there."""
    first = {r.repeat: r for r in rows if r.name == rows[0].name}
    out: dict[str, list[list[float]]] = {}
    for row in rows:
        ratios = out.setdefault(row.name, [[] for _ in row.stages])
        for i, (mine, theirs) in enumerate(zip(row.stages, first[row.repeat].stages)):
            if mine["num_failed"] == 0 and theirs["num_failed"] == 0 and theirs[
                    "num_output_tokens"] and mine["seconds"] > 0:
                ratios[i].append(_tps(mine) / _tps(theirs))
    return out


def _tps(stage: dict) -> float:
    return stage["num_output_tokens"] / stage["seconds"]


def format_stage_tables(rows: list[OnlineRow]) -> str:
    """Per server and stage: the median over repeats of tokens/s over the
    first server's (repeat by repeat), then of draft tokens per drafting
    request a step (what an adaptive server chose there)."""
    if not rows or not rows[0].stages:
        return ""
    labels = stage_labels([s["concurrency"] for s in rows[0].stages])
    header = f"{'per stage':<22}" + "".join(f"{label:>6}" for label in labels)
    lines = ["x first, median of the repeats", header, "-" * len(header)]
    for name, ratios in stage_speedups(rows).items():
        lines.append(f"{name:<22}" + "".join(
            f"{statistics.median(r):>6.2f}" if r else f"{'-':>6}" for r in ratios))
    lines += ["", "draft tokens per drafting request a step", header, "-" * len(header)]
    for name in dict.fromkeys(r.name for r in rows):
        mine = [r for r in rows if r.name == name]
        cells = []
        for i in range(len(labels)):
            drafts = sum(r.stages[i]["num_drafts"] for r in mine)
            tokens = sum(r.stages[i]["num_draft_tokens"] for r in mine)
            cells.append(f"{tokens / drafts:>6.1f}" if drafts else f"{'-':>6}")
        lines.append(f"{name:<22}" + "".join(cells))
    return "\n".join(lines)


def plot_stages(rows: list[OnlineRow], path: Path) -> None:
    """Each server's per-stage tokens/s over the first server's: median line
    over the repeats, their range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = stage_labels([s["concurrency"] for s in rows[0].stages])
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(labels))
    for name, ratios in stage_speedups(rows).items():
        middle = [statistics.median(r) if r else float("nan") for r in ratios]
        line, = ax.plot(xs, middle, marker="o", label=name)
        ax.fill_between(xs, [min(r) if r else float("nan") for r in ratios],
                        [max(r) if r else float("nan") for r in ratios],
                        color=line.get_color(), alpha=0.15)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(xs), labels)
    ax.set(xlabel="stage: concurrent clients (v: on the way down)",
           ylabel="tokens/s ÷ first server", title="speed-up per stage of the ramp")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
