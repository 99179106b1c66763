"""Whom a draining batch's draft length serves (issue 27).

The batch policy (batch_draft_length.py) weighs a length by the tokens it
gains the batch's mean request a second. That is the engine's throughput
while requests wait: whoever finishes early is replaced. Once nothing waits
the batch drains, and its time is set by the request with the most steps
left: drafts that shorten the others' lives shorten nothing. On CPU
(SmolLM2, `specplug_suffix`, one wave of 16 requests of 48 tokens) every wave
took about 48 steps at every length, its slowest request accepting next to
nothing, while each step at K=5 cost 4-11% more than without drafts
(docs/results/batch_draft_length_cpu_run14, run15/).

`RequestGains` keeps, per request, its accepted drafts against what the
batch's mean expected of a request at the lengths it was verified at (a
faded ratio, shrunk toward 1 by `PRIOR` expected drafts). While nothing
waits, `focus` names the ratio of the request with the most steps left
(tokens to its `max_tokens` over its own expected tokens a step), and the
policy weighs a length k by that request's gain, 1 + ratio * (E[k] - 1).
Tokens left are read to `max_tokens`: a request that will end early at a
stop token may be taken for the slowest while it runs.

Opt-in (`"adaptive_focus": true` beside the batch policy): on a simulated
wave it ran 8% shorter than the mean's weighing
(tests/test_batch_draft_length_phases_unit.py), but the CPU engine showed no gain
(docs/results/batch_draft_length_cpu_run16).
"""
from __future__ import annotations

from collections.abc import Iterable

# pseudo-observations at ratio 1: a request's ratio moves from the batch's
# mean only as its own accepted drafts outweigh this many expected ones
PRIOR = 2.0
FADE = 0.95  # per observation of a request: about its last 20 steps count


class RequestGains:
    def __init__(self) -> None:
        # req_id -> [faded accepted drafts, faded drafts the batch's mean expected]
        self.sums: dict[str, list[float]] = {}

    def observed(self, req_id: str, accepted: int, expected_accepted: float) -> None:
        """One verify step of `req_id`: `accepted` drafts of those verified,
        where the batch's mean request was expected to have
        `expected_accepted` (E[k] - 1 at that step's length k)."""
        sums = self.sums.setdefault(req_id, [0.0, 0.0])
        sums[0] = sums[0] * FADE + accepted
        sums[1] = sums[1] * FADE + expected_accepted

    def ratio(self, req_id: str) -> float:
        """The request's accepted drafts over the batch mean's (1: unseen)."""
        accepted, expected = self.sums.get(req_id, (0.0, 0.0))
        return (accepted + PRIOR) / (expected + PRIOR)

    def focus(self, tokens_left: Iterable[tuple[str, int]], expected_now: float) -> float | None:
        """The ratio of the request with the most steps left, each given as
        (req_id, tokens to its max_tokens), its steps its tokens over its
        own expected tokens a step at the current length (`expected_now`,
        the batch mean's); None for an empty batch."""
        most, found = -1.0, None
        for req_id, left in tokens_left:
            ratio = self.ratio(req_id)
            steps = max(left, 1) / (1.0 + ratio * max(expected_now - 1.0, 0.0))
            if steps > most:
                most, found = steps, ratio
        return found

    def forget(self, req_ids: Iterable[str]) -> None:
        """Finished requests."""
        for req_id in req_ids:
            self.sums.pop(req_id, None)
