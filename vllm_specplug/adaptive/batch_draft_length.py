"""One draft length for the whole batch, chosen each step from measured step
costs and live acceptance (Model Runner V2 under async scheduling).

Under vLLM's `AsyncScheduler` every running request gets the same number of
speculative slots, so a per-request cut (controller.py) saves nothing there:
the cut slots are padded and verified all the same. What can change from one
step to the next is that number, K, for the whole batch: vLLM's dynamic
speculative decoding (`num_speculative_tokens_per_batch_size`) looks it up
per step in a static table of batch sizes, and Model Runner V2 captures a
FULL CUDA graph per K of the table. `BatchDraftLength` stands in for that
table: asked for batch size b, it returns the K among its candidates
(0 included: no speculation) with the most expected tokens per second,

    tokens/s(K) = b * E[tokens per request | K] / seconds(b, K),

where E comes from the accepted counts of recent steps verified at that K
(a request gains 1 + accepted tokens; for chains and trees alike the mean
can only grow with K, so it is kept non-decreasing), and seconds(b, K) from
a line per K in the step's tokens b * (K + 1) (cost_model.StepCostModel),
fitted to the wall time between steps. A step counts for the cost of K only
when it both verified K drafts per request and drafted K for the next (the
drafting of step t is paid in step t, its verification in step t + 1), and
only when it was a pure decode step.

Every candidate is measured `num_warmup` times first. After that, one step
in `explore_every` tries another length, twice in a row so that one of the
two counts: mostly a neighbour of the current one (cheap to try, and where
the best length moves as the batch grows and shrinks), at times the length
measured least recently. A change needs a `switch_margin` gain over
the current K: two lengths that are about as good do not alternate.

Related: vLLM's adaptive verification (DSpark, per-slot budgets from draft
confidences); SpecDec++ (Huang et al., 2024) and DISCO (Mamou et al., 2024)
choose K per step from acceptance alone, without the step's cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm_specplug.adaptive.cost_model import StepCostModel

# one exploration in this many measures the length measured least recently
# (the others try the current length's neighbours)
FAR_EVERY = 4


def draft_length_candidates(max_k: int) -> tuple[int, ...]:
    """0, 1, 2, 4, 8, ... below `max_k`, and `max_k`: few lengths (each is a
    FULL-graph family to capture and a choice to keep measured), spaced so
    that the gain of one more doubling is visible."""
    lengths = {0, max_k}
    power = 1
    while power < max_k:
        lengths.add(power)
        power *= 2
    return tuple(sorted(lengths))


@dataclass
class LengthStats:
    """What is known about one candidate K."""
    cost: StepCostModel = field(default_factory=StepCostModel)
    accepted: float = 0.0  # faded sum of accepted drafts per request
    num_requests: float = 0.0  # faded count of requests verified at this K
    last_measured: int = -1  # decode step at which its cost was last observed
    num_chosen: int = 0  # steps it was chosen for (not explored)
    num_tries: int = 0  # explorations of it


@dataclass
class BatchDraftStats:
    num_steps: int = 0  # steps scheduled with a decision
    num_explored: int = 0
    num_measured: int = 0  # steps whose cost counted
    # expected vs realised tokens per request of the steps verified at a
    # length chosen for exploitation (not for exploration)
    expected_tokens: float = 0.0
    realised_tokens: float = 0.0
    num_requests: int = 0


class BatchDraftLength:
    """`lookup[batch_size] -> K`, as vLLM's dense dynamic-SD table is read.

    Args:
        candidates: the lengths it may choose (ascending, 0 allowed).
        explore_every: one step in this many measures another length.
        acceptance_fade: per request verified at a length, the weight its
            older accepted counts keep (about 1 / (1 - fade) requests count).
    """

    def __init__(self, candidates: tuple[int, ...], explore_every: int = 32,
                 num_warmup: int = 4, switch_margin: float = 0.02,
                 acceptance_fade: float = 0.995) -> None:
        if not candidates or list(candidates) != sorted(set(candidates)) or candidates[0] < 0:
            raise ValueError(f"candidates must be ascending lengths >= 0, got {candidates}")
        self.candidates = tuple(candidates)
        self.lengths = {k: LengthStats(cost=StepCostModel(num_warmup=num_warmup))
                        for k in candidates}
        self.explore_every, self.num_warmup = explore_every, num_warmup
        self.switch_margin, self.acceptance_fade = switch_margin, acceptance_fade
        self.current = candidates[-1]
        self.exploring: int | None = None  # the length an exploration holds
        self.explore_left = 0  # steps it still holds it
        self.num_decode_steps = 0
        self.stats = BatchDraftStats()
        self.last_expected: dict[int, float] = {}  # K -> E[tokens/request] when chosen

    def __getitem__(self, batch_size: int) -> int:
        return self.choose(int(batch_size))

    def choose(self, batch_size: int) -> int:
        self.stats.num_steps += 1
        if self.explore_left > 0:
            self.explore_left -= 1
            return self.exploring
        untried = [k for k in self.candidates if self._untried(k)]
        if untried:
            return self._hold(min(untried, key=lambda k: self.lengths[k].num_tries))
        if self.stats.num_steps % self.explore_every == 0:
            return self._hold(self._next_to_explore())
        rates = {k: self.tokens_per_second(k, batch_size) for k in self.candidates}
        best = max(rates, key=rates.get)
        if rates[best] > rates[self.current] * (1 + self.switch_margin):
            self.current = best
        self.lengths[self.current].num_chosen += 1
        self.last_expected[self.current] = self.expected_tokens(self.current)
        return self.current

    def _untried(self, k: int) -> bool:
        """Measured fewer than `num_warmup` times, and not for lack of tries
        (a length whose steps never count, all mixed with prefills, stops
        being tried after 4 x `num_warmup`)."""
        stats = self.lengths[k]
        return stats.cost.num_samples < self.num_warmup and stats.num_tries < 4 * self.num_warmup

    def _next_to_explore(self) -> int:
        """The current length's neighbours in turn (where the best length
        moves to as the batch changes, and cheap to try), and every
        `FAR_EVERY`-th time the length measured least recently."""
        self.stats.num_explored += 1
        i = self.candidates.index(self.current)
        near = [self.candidates[j] for j in (i - 1, i + 1) if 0 <= j < len(self.candidates)]
        if self.stats.num_explored % FAR_EVERY == 0 or not near:
            others = [k for k in self.candidates if k != self.current] or [self.current]
            return min(others, key=lambda k: self.lengths[k].last_measured)
        return near[self.stats.num_explored // FAR_EVERY % len(near)
                    if len(near) == 1 else self.stats.num_explored % 2]

    def _hold(self, k: int) -> int:
        """Try `k` for this step and the next: only the second both drafts
        and verifies k, and counts for its cost."""
        self.exploring, self.explore_left = k, 1
        self.lengths[k].num_tries += 1
        return k

    def expected_tokens(self, k: int) -> float:
        """E[tokens a request gains per step | K = k]: 1 + accepted, non-
        decreasing in K (a longer chain or a bigger tree keeps the shorter
        one's nodes); a length not yet verified takes the one below it."""
        best = 1.0
        for length in self.candidates:
            stats = self.lengths[length]
            if length > 0 and stats.num_requests > 0:
                best = max(best, 1.0 + stats.accepted / stats.num_requests)
            if length == k:
                return best
        raise KeyError(k)

    def tokens_per_second(self, k: int, batch_size: int) -> float:
        seconds = self.lengths[k].cost.predict(batch_size * (k + 1))
        return batch_size * self.expected_tokens(k) / max(seconds, 1e-9)

    def verified(self, k: int, num_accepted: list[int]) -> None:
        """A step verified `k` drafts per request; `num_accepted` per request.
        Steps at the length it exploits also count in expected vs realised
        (the expectation it had when it last chose that length)."""
        if k not in self.lengths or not num_accepted:
            return
        stats = self.lengths[k]
        fade = self.acceptance_fade ** len(num_accepted)
        stats.accepted = stats.accepted * fade + sum(num_accepted)
        stats.num_requests = stats.num_requests * fade + len(num_accepted)
        if k == self.current and k in self.last_expected:
            self.stats.expected_tokens += self.last_expected[k] * len(num_accepted)
            self.stats.realised_tokens += len(num_accepted) + sum(num_accepted)
            self.stats.num_requests += len(num_accepted)

    def measured(self, k: int, num_tokens: int, seconds: float) -> None:
        """A pure decode step that verified and drafted `k` took `seconds`."""
        if k not in self.lengths:
            return
        self.num_decode_steps += 1
        stats = self.lengths[k]
        if stats.cost.observe(num_tokens, seconds):
            stats.last_measured = self.num_decode_steps
            self.stats.num_measured += 1

    def as_dict(self) -> dict:
        s = self.stats
        return {"candidates": list(self.candidates), "current": self.current,
                "num_steps": s.num_steps, "num_explored": s.num_explored,
                "num_measured": s.num_measured,
                "chosen": {k: self.lengths[k].num_chosen for k in self.candidates},
                "expected_tokens_per_request": (s.expected_tokens / s.num_requests
                                                if s.num_requests else None),
                "realised_tokens_per_request": (s.realised_tokens / s.num_requests
                                                if s.num_requests else None),
                "cost_lines": {k: list(self.lengths[k].cost.coefficients())
                               for k in self.candidates}}
