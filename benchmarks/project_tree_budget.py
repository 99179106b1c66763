"""What the tree budget (`adaptive/tree_budget.py`, issue 27) would do on the
Llama-3-8B shape: the policy run against a simulated engine whose step
times are the ones measured on an H100 and whose acceptance is a measured
per-node profile. No GPU, no engine: a projection, not a measurement.

Step costs come from a `bench_v2_steps.py` JSON (default: this session's
`docs/results/v2_head_attention_h100/steps8b/v2_steps.json`), per batch size:
- a step without drafts: `none`'s median step;
- a step that verifies T tokens: piecewise linear in T through the rows of
  our chain (T = 6 B) and trees (17 B, 33 B), each less its drafting pass
  (`decode_step` GPU ms), extended with the end slopes;
- the drafting pass, paid when any request drafts: the method's `decode_step`.

Acceptance: P(node j accepted) per list index of a 16-node tree, and per
position of a chain (default: the tiny model's head, from the CPU tree-budget
run's `node_acceptance` and `tiny3`'s per-position acceptance). The
simulated engine draws each kept node's acceptance with its rate (the
marginals are right; paths are not modelled), so a request gains
sum(rates[:n]) tokens a step in expectation.

    .venv/bin/python benchmarks/project_tree_budget.py --out docs/results/tree_budget_8b_projection

Writes `projection.json`, `projection.txt` and `projection.png`: per batch
size and method, tokens/s of no speculation, of every static size and of
the budget, and what the budget chose (mean nodes kept, share of steps
skipped).
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_specplug.adaptive.tree_budget import TreeBudget

HERE = Path(__file__).resolve().parent
STEPS = HERE.parent / "docs/results/v2_head_attention_h100/steps8b/v2_steps.json"
# the tiny model's head (CPU tree-budget run, batch 1: docs/results/tree_budget_cpu)
TREE16_RATES = [0.7547, 0.195, 0.0802, 0.0554, 0.5619, 0.1556, 0.0889, 0.0316, 0.0787, 0.1666,
                0.1159, 0.1113, 0.1062, 0.0897, 0.1037]
# the same head's chain of 5 on the H100 (docs/results/v2_head_attention_h100/tiny3, batch 1)
CHAIN5_RATES = [0.86, 0.57, 0.41, 0.22, 0.18]
METHODS = {"tree16": ("ours-tree16", TREE16_RATES), "chain5": ("ours-chain-K5", CHAIN5_RATES)}
SPEC_ROWS = {"ours-chain-K5": 5, "ours-tree16": 15, "ours-tree32": 31}  # draft nodes per request


@dataclass
class StepCosts:
    """One batch size's measured costs, seconds."""
    plain: float  # a step without drafts
    spec_tokens: list[float]  # verified tokens of the speculative rows, ascending
    spec_seconds: list[float]  # their steps less the drafting pass
    draft: dict[str, float]  # method row -> its drafting pass

    def verify(self, num_tokens: int) -> float:
        """A speculative step's time without its drafting pass."""
        x, y = self.spec_tokens, self.spec_seconds
        if num_tokens <= x[0]:
            slope = (y[1] - y[0]) / (x[1] - x[0])
            return y[0] - slope * (x[0] - num_tokens)
        if num_tokens >= x[-1]:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            return y[-1] + slope * (num_tokens - x[-1])
        return float(np.interp(num_tokens, x, y))


def load_costs(path: Path) -> dict[int, StepCosts]:
    """{batch: StepCosts} from a bench_v2_steps.py JSON (median step ms)."""
    rows = json.loads(path.read_text())
    costs: dict[int, StepCosts] = {}
    for batch in sorted({r["batch"] for r in rows}):
        of = {r["method"]: r for r in rows if r["batch"] == batch}
        draft = {m: of[m]["phases"]["profiled"]["phases"]["decode_step"]["gpu_ms"] / 1e3
                 for m in SPEC_ROWS if m in of}
        spec = sorted((batch * (1 + SPEC_ROWS[m]),
                       statistics.median(of[m]["step_ms"]) / 1e3 - draft[m]) for m in draft)
        costs[batch] = StepCosts(statistics.median(of["none"]["step_ms"]) / 1e3,
                                 [t for t, _ in spec], [s for _, s in spec], draft)
    return costs


class SimulatedEngine:
    """B requests decoding under one cost table and one acceptance profile."""

    def __init__(self, costs: StepCosts, method_row: str, rates: list[float], seed: int = 0):
        self.costs, self.draft = costs, costs.draft[method_row]
        self.rates = np.asarray(rates)
        self.rng = np.random.default_rng(seed)
        self.now = 0.0

    def step_seconds(self, num_reqs: int, sizes: list[int]) -> float:
        if not any(sizes):
            return self.costs.plain
        return self.costs.verify(num_reqs + sum(sizes))

    def static_rate(self, num_reqs: int, num_kept: int) -> float:
        """Expected tokens per second with every request keeping `num_kept`."""
        if num_kept == 0:
            return num_reqs / self.costs.plain
        gained = float(self.rates[:num_kept].sum())
        seconds = self.costs.verify(num_reqs * (1 + num_kept)) + self.draft
        return num_reqs * (1 + gained) / seconds

    def accepted(self, num_kept: int) -> list[int]:
        draws = self.rng.random(num_kept)
        return [j for j in range(num_kept) if draws[j] < self.rates[j]]


def run_budget(engine: SimulatedEngine, num_reqs: int, steps: int = 2000) -> dict:
    """The budget against the engine; tokens/s over the second half."""
    num_nodes = len(engine.rates)
    budget = TreeBudget(num_nodes, clock=lambda: engine.now)
    req_ids = [f"r{i}" for i in range(num_reqs)]
    last = {r: (0, []) for r in req_ids}
    tokens, start, num_tokens, kept = 0, 0.0, num_reqs, []
    for step in range(steps):
        if step == steps // 2:
            tokens, start, kept = 0, engine.now, []
        budget.step_done(num_tokens, num_tokens - num_reqs)
        for req_id in req_ids:
            budget.verified(req_id, *last[req_id])
        sizes = budget.plan(req_ids, num_reqs, num_nodes)
        if any(sizes):
            engine.now += engine.draft
            budget.drafted(sum(1 for n in sizes if n), engine.draft)
        engine.now += engine.step_seconds(num_reqs, sizes)
        num_tokens = num_reqs + sum(sizes)
        kept.append(sizes)
        for req_id, size in zip(req_ids, sizes):
            last[req_id] = (size, engine.accepted(size))
            tokens += 1 + len(last[req_id][1])
    kept_array = np.asarray(kept)
    return {"tokens_per_s": tokens / (engine.now - start),
            "mean_nodes_kept": float(kept_array.mean()),
            "skipped_share": float((kept_array.sum(1) == 0).mean())}


def project(costs: dict[int, StepCosts], seed: int = 0, steps: int = 2000) -> list[dict]:
    rows = []
    for method, (row_name, rates) in METHODS.items():
        for batch, batch_costs in costs.items():
            engine = SimulatedEngine(batch_costs, row_name, rates, seed)
            static = [engine.static_rate(batch, n) for n in range(len(rates) + 1)]
            best = int(np.argmax(static))
            rows.append({"method": method, "batch_size": batch, "static_tokens_per_s": static,
                         "none": static[0], "full": static[-1], "best_static_nodes": best,
                         "best_static": static[best], **run_budget(engine, batch, steps)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["method   batch  none tok/s  full tree  best static (nodes)  budget    "
             "budget/best  nodes kept  skipped"]
    for r in rows:
        lines.append(
            f"{r['method']:8s} {r['batch_size']:5d} {r['none']:11.1f} {r['full']:10.1f} "
            f"{r['best_static']:12.1f} ({r['best_static_nodes']:2d}) {r['tokens_per_s']:9.1f} "
            f"{r['tokens_per_s'] / r['best_static']:11.3f} {r['mean_nodes_kept']:11.2f} "
            f"{r['skipped_share']:8.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, policy: str = "the budget",
         xlabel: str = "nodes kept") -> None:
    """Per method, each batch size's static sizes over no speculation, and
    the policy's rate dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(METHODS)
    figure, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 3.6))
    for ax, method in zip(np.atleast_1d(axes), methods):
        for r in (r for r in rows if r["method"] == method):
            static = np.asarray(r["static_tokens_per_s"]) / r["none"]
            ax.plot(range(len(static)), static, marker=".", label=f"batch {r['batch_size']}")
            ax.axhline(r["tokens_per_s"] / r["none"], linestyle="--",
                       color=ax.lines[-1].get_color())
        ax.set(title=f"{method}: static sizes (dashed: {policy})", xlabel=xlabel,
               ylabel="x no speculation")
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def cli(argv: list[str] | None, doc: str, project_rows, table_text, **plot_labels) -> int:
    """A projection script's command line: `--steps-json`, `--out`; writes
    projection.json / .txt / .png and prints the table."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps-json", type=Path, default=STEPS)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = project_rows(load_costs(args.steps_json))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "projection.json").write_text(json.dumps(rows, indent=1))
    text = table_text(rows)
    (args.out / "projection.txt").write_text(text + "\n")
    plot(rows, args.out / "projection.png", **plot_labels)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__, project, table)


if __name__ == "__main__":
    raise SystemExit(main())
