"""What the batch draft-length policy (`adaptive/batch_draft_length.py`,
`"adaptive": true` on Model Runner V2, issue 27) would do on the
Llama-3-8B shape: the policy run against a simulated engine whose step
times are the ones measured on an H100 and whose acceptance is a measured
per-node profile. No GPU, no engine: a projection, not a measurement.

The step costs, the acceptance profiles and the simulated engine are
`project_tree_budget.py`'s (its docstring says how each is read). The batch
policy chooses one length for the whole batch each step, among
`draft_length_candidates` (0, 1, 2, 4, 8, 15 for the 16-node tree; 0, 1, 2,
4, 5 for the chain), as the scheduler drives it: the length chosen at a step
is drafted there and verified at the next; a step's time counts for its
length once settled (it and the step before verified and drafted it); each
step's time moves by up to 3%. A tree step's accepted nodes also come as
their ranks (the list index), as Model Runner V2 reports them, so that
every smaller tree learns from it. A steady batch of B requests, 2000
steps; tokens/s over the second half.

    .venv/bin/python benchmarks/project_batch_policy.py --out docs/results/batch_policy_8b_projection

Writes `projection.json`, `projection.txt` and `projection.png`: per batch
size and method, tokens/s of no speculation, of every static size and of
the policy, and what it chose (share of steps per length).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
from project_tree_budget import METHODS, SimulatedEngine, StepCosts, cli

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates

NOISE = 0.03


def _step(policy: BatchDraftLength, engine: SimulatedEngine, num_reqs: int,
          verified: int, chains: bool) -> tuple[int, float]:
    """One step that verifies `verified` drafts per request: (tokens, seconds)."""
    seconds = engine.draft if verified else 0.0
    seconds += engine.step_seconds(num_reqs, [verified] * num_reqs)
    seconds *= engine.rng.uniform(1 - NOISE, 1 + NOISE)
    nodes = [engine.accepted(verified) for _ in range(num_reqs)]
    policy.verified(verified, [len(n) for n in nodes])
    if verified and not chains:
        width = len(engine.rates)
        ranks = np.full((num_reqs, width), width + 1, dtype=np.int32)
        for row, accepted in enumerate(nodes):
            ranks[row, :len(accepted)] = accepted
        policy.verified_within(verified, ranks)
    return num_reqs + sum(len(n) for n in nodes), seconds


def run_policy(engine: SimulatedEngine, num_reqs: int, chains: bool,
               steps: int = 2000) -> dict:
    """The batch policy against the engine; tokens/s over the second half."""
    policy = BatchDraftLength(draft_length_candidates(len(engine.rates)), chains=chains)
    drafted = last_verified = policy.choose(num_reqs)
    tokens, start, chosen = 0, 0.0, Counter()
    for step in range(steps):
        if step == steps // 2:
            tokens, start, chosen = 0, engine.now, Counter()
        verified, drafted = drafted, policy.choose(num_reqs)
        gained, seconds = _step(policy, engine, num_reqs, verified, chains)
        engine.now += seconds
        tokens += gained
        settled = last_verified == verified == drafted
        last_verified = verified
        policy.stepped("decode" if settled else "switch", seconds)
        if settled:
            policy.measured(verified, num_reqs, seconds)
        chosen[verified] += 1
    total = sum(chosen.values())
    return {"tokens_per_s": tokens / (engine.now - start),
            "chosen": {k: chosen[k] / total for k in sorted(chosen)}}


def project(costs: dict[int, StepCosts], seed: int = 0, steps: int = 2000) -> list[dict]:
    rows = []
    for method, (row_name, rates) in METHODS.items():
        candidates = draft_length_candidates(len(rates))
        for batch, batch_costs in costs.items():
            engine = SimulatedEngine(batch_costs, row_name, rates, seed)
            static = [engine.static_rate(batch, n) for n in range(len(rates) + 1)]
            best = max(candidates, key=lambda n: static[n])
            best_any = int(np.argmax(static))  # lengths outside the candidates too
            rows.append({"method": method, "batch_size": batch, "static_tokens_per_s": static,
                         "none": static[0], "best_static_length": best,
                         "best_static": static[best], "best_any_length": best_any,
                         "best_any": static[best_any],
                         **run_policy(engine, batch, method != "tree16", steps)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["method   batch  none tok/s  best candidate (length)  best of any  policy    "
             "policy/best  policy/any  chosen (share of steps)"]
    for r in rows:
        shares = " ".join(f"{k}:{share:.0%}" for k, share in r["chosen"].items() if share >= 0.01)
        lines.append(
            f"{r['method']:8s} {r['batch_size']:5d} {r['none']:11.1f} {r['best_static']:15.1f} "
            f"({r['best_static_length']:2d}) {r['best_any']:8.1f} ({r['best_any_length']:2d}) "
            f"{r['tokens_per_s']:9.1f} {r['tokens_per_s'] / r['best_static']:11.3f} "
            f"{r['tokens_per_s'] / r['best_any']:10.3f}  {shares}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__, project, table, policy="the batch policy",
               xlabel="drafts per request")


if __name__ == "__main__":
    raise SystemExit(main())
