"""Expected tokens per request at each draft length, for the batch policy
(batch_draft_length.py): a faded mean per length, non-decreasing in length,
and a length found stale made to relearn fast.

How many drafts are accepted depends on the requests running (a batch of
easy prompts accepts more at every length), and a length the policy does
not run is seen only when it is tried, one step in tens. On the H200
(docs/results/batch_draft_length_h200_run6) the batch-256 phase left every
tree size but the current one with its acceptance there; at batch 1 the
current 4-node tree was re-measured on easier requests, the 15-node tree
kept the batch-256 figure below it, the rule that a longer draft accepts at
least the shorter's tokens made them equal, and the policy ran 4 nodes for
37% of the steps where 15 are best. A longer length's mean that falls
`STALE_BY` below a shorter length's more recent one cannot hold for the same
requests: it is marked stale (`stale`, which the policy tries first), and
its next samples count as if it had seen only `RELEARN_REQUESTS` requests
before. (Ratios between neighbouring lengths, sampled when both ran close
together, were tried first: they move with the requests too, 1.0 between 4
and 8 drafts at low acceptance and 1.26 at high, so a ratio from one phase
misled the next.)
"""
from __future__ import annotations

from dataclasses import dataclass

# a longer length's mean this far below a shorter one's fresher mean is stale
STALE_BY = 0.05
# a stale length's older samples are kept as this many requests' worth
RELEARN_REQUESTS = 2.0


@dataclass
class _Length:
    accepted: float = 0.0  # faded sum of accepted drafts per request
    num_requests: float = 0.0  # faded count of requests verified at this length
    stamp: float = 0.0  # faded sum of (verified step index x requests): their mean age

    def mean(self) -> float | None:
        return 1.0 + self.accepted / self.num_requests if self.num_requests > 0 else None

    def mean_step(self) -> float:
        return self.stamp / self.num_requests if self.num_requests > 0 else -1.0


class LengthAcceptance:
    """E[tokens a request gains per step | length k] (1 + accepted drafts),
    non-decreasing in k (a longer chain or bigger tree keeps the shorter
    one's nodes); a length never verified is taken at its best, 1 + k.

    Args:
        candidates: ascending lengths (0: no drafts, always 1 token).
        fade: per request verified at a length, the weight its older counts
            keep (about 1 / (1 - fade) requests count).
        chains: a step verified at k also tells every shorter length's count
            (min(accepted, length)): chains' first drafts are the shorter
            chain's.
    """

    def __init__(self, candidates: tuple[int, ...], fade: float = 0.995,
                 chains: bool = True) -> None:
        self.candidates, self.fade, self.chains = tuple(candidates), fade, chains
        self.lengths = {k: _Length() for k in self.candidates if k > 0}
        self.num_steps = 0
        self.num_relearned = 0  # samples a stale length took after dropping its past
        self._expected: dict[int, float] | None = None

    def verified(self, k: int, num_accepted: list[int]) -> None:
        """A step verified `k` drafts per request; `num_accepted` per request."""
        if k not in self.lengths or not num_accepted:
            return
        self._expected = None
        self.num_steps += 1
        n, stale = len(num_accepted), set(self.stale())
        for length in (self.lengths if self.chains else (k,)):
            if length <= k:
                self._add(length, sum(min(a, length) for a in num_accepted), n, stale)

    def verified_within(self, k: int, path_ranks) -> None:
        """A tree step verified `k` drafts per request; `path_ranks` [n, N -
        1] (numpy) the node ranks of each request's accepted path, `N` past
        it (integration/v2/path_ranks.py). A path's ranks rise
        (`score_ranks`), so its nodes of rank < l are what the tree of l
        drafts, drafted from the same pool, would have had accepted: every
        length below k learns from the same requests on the same step (as a
        chain's shorter lengths do in `verified`), not only on the steps it
        is tried."""
        if self.chains or len(path_ranks) == 0:
            return
        self._expected = None
        n, stale = len(path_ranks), set(self.stale())
        for length in self.lengths:
            if length < k:
                self._add(length, int((path_ranks < length).sum()), n, stale)

    def _add(self, length: int, accepted: int, n: int, stale: set[int]) -> None:
        """`n` requests accepted `accepted` drafts in all at `length`."""
        stats, fade = self.lengths[length], self.fade ** n
        if length in stale and stats.num_requests > RELEARN_REQUESTS:
            keep = RELEARN_REQUESTS / stats.num_requests
            stats.accepted, stats.stamp = stats.accepted * keep, stats.stamp * keep
            stats.num_requests = RELEARN_REQUESTS
            self.num_relearned += 1
        stats.accepted = stats.accepted * fade + accepted
        stats.num_requests = stats.num_requests * fade + n
        stats.stamp = stats.stamp * fade + self.num_steps * n

    def stale(self) -> list[int]:
        """Lengths whose mean is `STALE_BY` below a shorter length's whose
        samples are more recent (their mean step): learnt on other requests."""
        out, best, best_step = [], 0.0, -1.0
        for k, stats in self.lengths.items():
            mean = stats.mean()
            if mean is None:
                continue
            if mean < best * (1 - STALE_BY) and stats.mean_step() < best_step:
                out.append(k)
            elif mean > best:
                best, best_step = mean, stats.mean_step()
        return out

    def expected(self, k: int) -> float:
        if self._expected is None:  # taken again after each verified step
            self._expected, best = {}, 1.0
            for length in self.candidates:
                if length > 0:
                    mean = self.lengths[length].mean()
                    best = max(best, mean if mean is not None else 1.0 + length)
                self._expected[length] = best
        return self._expected[k]
