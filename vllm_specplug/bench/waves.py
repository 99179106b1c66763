"""Each `generate` call of a bench repeat as a wave of requests, timed by the
engine core's own timestamps (vLLM's `RequestStateStats` on each
`RequestOutput`, with stats on): how long the wave's first step took, how
long its requests decoded, and how much longer the slowest took than the
typical one. A method whose requests accept unevenly leaves a tail of steps
with few requests: a per-step price (the batch draft length's) does not see
it, and a bench of waves pays it (docs/results/batch_draft_length_h200_run15).
A tail is a request that started late or one that decoded slowly: both are
kept (at batch 64 on the H100 our chain's waves took 125 steps for 128
tokens where vLLM's took 110, docs/results/smollm2_chains_b64_h100_s72).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass
class WaveTimes:
    """Sums over a row's waves (ms)."""
    num_waves: int = 0
    first_step_ms: float = 0.0  # the wave's first schedule to its first token
    first_step_max_ms: float = 0.0  # the slowest wave's: one stalled wave stands out
    decode_ms: float = 0.0  # its first token to its last
    request_decode_ms: float = 0.0  # a request's own first to last token, the median
    # what makes a tail: a request that got its first token late (its prefill
    # waited for the token budget), or one that decoded slowly on its own
    last_start_ms: float = 0.0  # the wave's first token to its last request's first
    slowest_request_ms: float = 0.0  # the slowest request's own first to last token

    def add(self, outputs) -> None:
        """One wave's `RequestOutput`s (those without stats are skipped)."""
        stats = [o.metrics for o in outputs if getattr(o, "metrics", None) is not None
                 and getattr(o.metrics, "first_token_ts", 0.0) > 0.0]
        if not stats:
            return
        first = min(s.first_token_ts for s in stats)
        first_step_ms = 1e3 * (first - min(s.scheduled_ts for s in stats))
        self.num_waves += 1
        self.first_step_ms += first_step_ms
        self.first_step_max_ms = max(self.first_step_max_ms, first_step_ms)
        self.decode_ms += 1e3 * (max(s.last_token_ts for s in stats) - first)
        own = [s.last_token_ts - s.first_token_ts for s in stats]
        self.request_decode_ms += 1e3 * statistics.median(own)
        self.last_start_ms += 1e3 * (max(s.first_token_ts for s in stats) - first)
        self.slowest_request_ms += 1e3 * max(own)

    def merged(self, total: dict | None) -> dict | None:
        """`total` (an earlier repeat's `as_dict`, or None) plus these."""
        if not self.num_waves:
            return total
        mine = asdict(self)
        if total is None:
            return mine
        merged = {k: total.get(k, 0.0) + mine[k] for k in mine}
        merged["first_step_max_ms"] = max(total.get("first_step_max_ms", 0.0),
                                          self.first_step_max_ms)
        return merged


def wave_cells(waves: dict) -> str:
    """Per wave: first step ms (mean, and the slowest wave's), decode ms, the
    tail (decode over the median request's decode), the last request's start
    and the slowest request's own decode (ms: "-" in results written before
    they were recorded)."""
    n = max(waves["num_waves"], 1)
    tail = waves["decode_ms"] / max(waves["request_decode_ms"], 1e-9)

    def cell(key: str, width: int, per_wave: bool = True) -> str:
        value = waves.get(key)
        text = "-" if value is None else f"{value / (n if per_wave else 1):.1f}"
        return f"{text:>{width}}"
    return (f"{waves['num_waves']:>7}{waves['first_step_ms'] / n:>16.1f}"
            f"{cell('first_step_max_ms', 10, per_wave=False)}"
            f"{waves['decode_ms'] / n:>12.1f}{tail:>8.2f}"
            f"{cell('last_start_ms', 13)}{cell('slowest_request_ms', 14)}")
