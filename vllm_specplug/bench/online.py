"""Online benchmark: concurrent streaming clients against running
OpenAI-compatible servers (`vllm serve`, ours or anyone's), one after another.

Per request: time to first token (TTFT) and inter-token latency (ITL: the time
between the first and the last token over the tokens in between; a
speculative server sends several tokens per chunk, so per-chunk gaps would
mislead). Per (server, concurrency): requests/s, output tokens/s, TTFT and ITL
percentiles, and speculation counters read from `/metrics` before and after.
Chat prompts go to /v1/chat/completions, plain ones to /v1/completions.
"""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from vllm_specplug.bench.compare import token_mismatches
from vllm_specplug.bench.prompts import BenchPrompt
from vllm_specplug.metrics import SpecDecodeCounts, parse_prometheus_counts

PERCENTILES = (50, 90, 99)


class ServerError(RuntimeError):
    """A server that cannot be reached or answers with an error."""


@dataclass(frozen=True)
class Server:
    name: str
    url: str          # http://host:port, no trailing /v1
    model: str        # served model name


MAX_MISMATCHES_KEPT = 8  # per row in the JSON: enough to see which requests differ


@dataclass
class RequestTiming:
    text: str = ""
    num_tokens: int = 0
    ttft: float = math.nan
    itl: float = math.nan
    error: str | None = None


@dataclass
class OnlineRow:
    name: str
    concurrency: int
    num_requests: int
    num_completed: int = 0
    num_failed: int = 0
    seconds: float = 0.0
    num_output_tokens: int = 0
    ttft_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    counts: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    speedup: float = math.nan          # tokens/s over the first server's
    num_mismatches: int | None = None  # greedy texts differing from the first server's
    mismatches: list[str] = field(default_factory=list)  # the first few, request by request
    # of those, requests where the first server alone differs: every other
    # server (at least two) wrote the same text (`first_only`); None: not compared
    num_first_only: int | None = None
    texts: list[str] = field(default_factory=list, repr=False)
    load: str = "steady"  # or the ramp's stages (bench/ramp.py)
    stages: list[dict] = field(default_factory=list)  # a ramp's, stage by stage (bench/ramp.py)
    repeat: int = 0

    @property
    def requests_per_second(self) -> float:
        return self.num_completed / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds else 0.0


def _get(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ServerError(f"cannot reach {url}: {reason} (is the server running? "
                          "start one with `vllm serve MODEL`)") from None


def connect(name: str, url: str, model: str | None = None, timeout: float = 10) -> Server:
    """Check the server answers and find its served model name."""
    url = url.rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"--url {url!r}: expected http://HOST:PORT")
    try:
        served = [m["id"] for m in json.loads(_get(url + "/v1/models", timeout))["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"{url}/v1/models did not answer as an OpenAI-compatible "
                          "server does") from None
    if model is not None and model not in served:
        raise ServerError(f"{url} serves {served}, not --model-name {model!r}")
    return Server(name, url, model or served[0])


def read_counts(server: Server) -> SpecDecodeCounts:
    return parse_prometheus_counts(_get(server.url + "/metrics", 10).decode())


def _body(server: Server, prompt: BenchPrompt, max_tokens: int, temperature: float):
    body = {"model": server.model, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if prompt.messages is not None:
        return "/v1/chat/completions", {**body, "messages": prompt.messages}
    return "/v1/completions", {**body, "prompt": prompt.text}


def _chunk_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def stream_request(server: Server, prompt: BenchPrompt, max_tokens: int,
                   temperature: float, timeout: float) -> RequestTiming:
    """One streaming request, timed from sending to the last token."""
    path, body = _body(server, prompt, max_tokens, temperature)
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    timing, pieces, first, last = RequestTiming(), [], None, None
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    timing.num_tokens = chunk["usage"]["completion_tokens"]
                text = "".join(_chunk_text(c) for c in chunk.get("choices", []))
                if text:
                    last = time.perf_counter()
                    first = first or last
                    pieces.append(text)
    except (urllib.error.URLError, OSError, ValueError) as error:
        timing.error = f"{type(error).__name__}: {error}"
        return timing
    timing.text = "".join(pieces)
    if first is not None:
        timing.ttft = first - start
        if timing.num_tokens > 1:
            timing.itl = (last - first) / (timing.num_tokens - 1)
    return timing


def _percentiles(values: list[float]) -> dict:
    finite = [v * 1000 for v in values if not math.isnan(v)]
    if not finite:
        return {p: math.nan for p in PERCENTILES}
    return {p: float(np.percentile(finite, p)) for p in PERCENTILES}


def run_level(server: Server, prompts: list[BenchPrompt], concurrency: int,
              max_tokens: int, temperature: float, timeout: float,
              progress) -> OnlineRow:
    """All prompts through `concurrency` clients; counters around the run."""
    row = OnlineRow(server.name, concurrency, len(prompts))
    before = read_counts(server)
    start = time.perf_counter()
    timings = send_all(server, prompts, concurrency, max_tokens, temperature, timeout,
                       progress)
    fill_row(row, timings, time.perf_counter() - start, read_counts(server) - before)
    return row


def send_all(server: Server, prompts: list[BenchPrompt], concurrency: int, max_tokens: int,
             temperature: float, timeout: float, progress) -> list[RequestTiming]:
    """`prompts` through `concurrency` streaming clients; timings in order."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(stream_request, server, p, max_tokens, temperature, timeout)
                   for p in prompts]
        timings = []
        for future in futures:
            timings.append(future.result())
            progress.update(1)
    return timings


def fill_row(row: OnlineRow, timings: list[RequestTiming], seconds: float,
             counts: SpecDecodeCounts) -> None:
    row.seconds, row.counts = seconds, counts
    done = [t for t in timings if t.error is None]
    row.num_completed, row.num_failed = len(done), len(timings) - len(done)
    row.num_output_tokens = sum(t.num_tokens for t in done)
    row.ttft_ms = _percentiles([t.ttft for t in done])
    row.itl_ms = _percentiles([t.itl for t in done])
    row.texts = [t.text if t.error is None else None for t in timings]


def run_online(servers: list[Server], prompts: list[BenchPrompt], concurrencies: list[int],
               max_tokens: int, temperature: float = 0.0, timeout: float = 600
               ) -> list[OnlineRow]:
    rows = []
    with tqdm(total=len(servers) * len(concurrencies) * len(prompts), desc="bench online",
              unit="req") as progress:
        for server in servers:
            progress.set_postfix_str(server.name)
            for level in concurrencies:
                rows.append(run_level(server, prompts, level, max_tokens, temperature,
                                      timeout, progress))
    compare_to_first(rows, servers[0].name, greedy=temperature == 0)
    return rows


def compare_to_first(rows: list[OnlineRow], first: str, greedy: bool) -> None:
    """Speed-up and exactness against the first server's row of the same
    load, concurrency and repeat."""
    groups: dict[tuple, list[OnlineRow]] = {}
    for row in rows:
        groups.setdefault((row.load, row.concurrency, row.repeat), []).append(row)
    for group in groups.values():
        ref = next(r for r in group if r.name == first)
        for row in group:
            _compare(row, ref, greedy)
        if greedy:
            _count_first_only(group, ref)


def _compare(row: OnlineRow, ref: OnlineRow, greedy: bool) -> None:
    if ref.tokens_per_second:
        row.speedup = row.tokens_per_second / ref.tokens_per_second
    if greedy and row.num_failed == 0 and ref.num_failed == 0:
        # Text, not ids: streamed chunks carry text. Compared per character.
        found = token_mismatches([list(t) for t in ref.texts], [list(t) for t in row.texts])
        row.num_mismatches = len(found)
        # Which requests and where, to tell the target's own batch-shape
        # near-ties (the same requests in every row) from a drafter's fault.
        row.mismatches = found[:MAX_MISMATCHES_KEPT]


def first_only(reference: list, others: list[list]) -> set[int]:
    """Requests whose text all of `others` (at least two) share and the
    reference does not: where the reference alone differs, as its own
    numerics under another batch shape make it (a greedy near-tie flipped),
    not a speculator (vLLM's own among the others)."""
    if len(others) < 2:
        return set()
    return {i for i, text in enumerate(reference)
            if all(o[i] == others[0][i] for o in others[1:]) and others[0][i] != text}


def _count_first_only(group: list[OnlineRow], ref: OnlineRow) -> None:
    """Per row of a (load, concurrency, repeat) group: how many of its
    mismatches are requests where the first server (`ref`) alone differs."""
    others = [r for r in group if r is not ref and r.num_failed == 0]
    if ref.num_failed:
        return
    alone = first_only(ref.texts, [o.texts for o in others])
    for row in others:
        if row.num_mismatches is not None:
            row.num_first_only = sum(1 for i in alone if row.texts[i] != ref.texts[i])
