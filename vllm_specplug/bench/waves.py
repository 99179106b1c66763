"""Each `generate` call of a bench repeat as a wave of requests, timed by the
engine core's own timestamps (vLLM's `RequestStateStats` on each
`RequestOutput`, with stats on): how long the wave's first step took, how
long its requests decoded, and how much longer the slowest took than the
typical one. A method whose requests accept unevenly leaves a tail of steps
with few requests: a per-step price (the batch draft length's) does not see
it, and a bench of waves pays it (docs/results/batch_draft_length_h200_run15).
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
        self.request_decode_ms += 1e3 * statistics.median(
            s.last_token_ts - s.first_token_ts for s in stats)

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
    """Per wave: first step ms (mean, and the slowest wave's: absent from
    results written before it was recorded), decode ms, and the tail (decode
    over the median request's decode)."""
    n = max(waves["num_waves"], 1)
    tail = waves["decode_ms"] / max(waves["request_decode_ms"], 1e-9)
    slowest = waves.get("first_step_max_ms")
    return (f"{waves['num_waves']:>7}{waves['first_step_ms'] / n:>16.1f}"
            f"{'-' if slowest is None else f'{slowest:.1f}':>10}"
            f"{waves['decode_ms'] / n:>12.1f}{tail:>8.2f}")
