"""A bounded load on an OpenAI-compatible server: mixed requests from
concurrent clients, some aborted mid-stream by closing the connection.

The plan is deterministic for a seed, so the same requests can be sent to a
server with speculation and one without and their greedy outputs compared.
Every planned request ends in exactly one `LoadResult`; after the load the
server's `/metrics` tell whether everything was freed.
"""
from __future__ import annotations

import json
import random
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from vllm_specplug.bench.online import Server, _body, _chunk_text, _get
from vllm_specplug.bench.prompts import BenchPrompt

MAX_TOKENS_CHOICES = (1, 8, 24, 48)
ABORT_AFTER_CHUNKS = 2
_GAUGE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+(\S+)$", re.M)


@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt: BenchPrompt
    max_tokens: int
    stream: bool
    n: int = 1           # n > 1 samples (vLLM refuses n > 1 under greedy)
    abort: bool = False  # close the connection after ABORT_AFTER_CHUNKS chunks

    @property
    def greedy(self) -> bool:
        return self.n == 1


@dataclass
class LoadResult:
    index: int
    status: str = "failed"          # completed | aborted | failed
    texts: list[str] = field(default_factory=list)  # one per choice
    seconds: float = 0.0
    error: str | None = None


def make_plan(prompts: list[BenchPrompt], num_requests: int, seed: int = 0
              ) -> list[LoadRequest]:
    """Mixed lengths; ~1/3 non-streaming, ~1/10 aborted, ~1/10 sampled with
    n=2 (temperature 1, seeded), the rest greedy."""
    rng = random.Random(seed)
    plan = []
    for index in range(num_requests):
        kind = rng.random()
        stream = kind >= 0.33
        plan.append(LoadRequest(
            index, prompts[index % len(prompts)], rng.choice(MAX_TOKENS_CHOICES),
            stream, n=2 if 0.33 <= kind < 0.43 else 1,
            abort=stream and kind >= 0.9))
    return plan


def _request(server: Server, req: LoadRequest) -> urllib.request.Request:
    path, body = _body(server, req.prompt, req.max_tokens, 0.0 if req.greedy else 1.0)
    body.update(stream=req.stream, n=req.n)
    if not req.greedy:
        body["seed"] = req.index
    if not req.stream:
        body.pop("stream_options")
    return urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})


def _read_stream(response, req: LoadRequest, result: LoadResult) -> None:
    texts, chunks = [""] * req.n, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[5:]).get("choices", []):
            texts[choice["index"]] += _chunk_text(choice)
        chunks += 1
        if req.abort and chunks == ABORT_AFTER_CHUNKS:
            result.status = "aborted"
            return  # leaving the `with` closes the connection mid-stream
    result.texts, result.status = texts, "completed"


def send(server: Server, req: LoadRequest, timeout: float) -> LoadResult:
    result = LoadResult(req.index)
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(_request(server, req), timeout=timeout) as response:
            if req.stream:
                _read_stream(response, req, result)
            else:
                choices = sorted(json.loads(response.read())["choices"],
                                 key=lambda c: c["index"])
                result.texts = [c.get("text") or c["message"]["content"] or ""
                                for c in choices]
                result.status = "completed"
    except (urllib.error.URLError, OSError, ValueError, KeyError) as error:
        result.error = f"{type(error).__name__}: {error}"
    result.seconds = time.perf_counter() - start
    return result


def run_load(server: Server, plan: list[LoadRequest], concurrency: int,
             timeout: float = 120) -> tuple[list[LoadResult], float]:
    """(one result per planned request, in plan order; wall seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool, \
            tqdm(total=len(plan), desc=f"load {server.name}", unit="req") as bar:
        futures = [pool.submit(send, server, req, timeout) for req in plan]
        results = []
        for future in futures:
            results.append(future.result())
            bar.update(1)
    return results, time.perf_counter() - start


def server_gauges(server: Server) -> dict[str, float]:
    """vLLM's gauges and counters from `/metrics`, summed over label sets."""
    values: dict[str, float] = {}
    for name, value in _GAUGE.findall(_get(server.url + "/metrics", 10).decode()):
        values[name] = values.get(name, 0.0) + float(value)
    return values


def wait_until_idle(server: Server, seconds: float = 30) -> dict[str, float]:
    """Gauges once nothing runs or waits (aborts reach the engine a little
    after the client closes); the last reading if that never happens."""
    deadline = time.time() + seconds
    while True:
        gauges = server_gauges(server)
        idle = (gauges.get("vllm:num_requests_running", 0) == 0
                and gauges.get("vllm:num_requests_waiting", 0) == 0)
        if idle or time.time() > deadline:
            return gauges
        time.sleep(0.5)


def load_summary(results: list[LoadResult], seconds: float) -> dict:
    """Counts by status, completed requests/s and latency percentiles (ms)."""
    import numpy as np

    done = [r.seconds * 1000 for r in results if r.status == "completed"]
    by_status = {s: sum(r.status == s for r in results)
                 for s in ("completed", "aborted", "failed")}
    latency = {f"p{p}": float(np.percentile(done, p)) if done else None for p in (50, 99)}
    return {"sent": len(results), **by_status, "seconds": seconds,
            "requests_per_second": by_status["completed"] / seconds if seconds else 0.0,
            "latency_ms": latency}
