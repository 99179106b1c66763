"""Tables, the cost model and its check, from the JSON of `bench_tree_cuda.py`
(issue 15). Runs anywhere (no GPU):

    .venv/bin/python benchmarks/gpu/tree_cost_model.py --results DIR \\
        --ngram docs/results/model_runner_v2_h100.json --out docs/results/tree_cuda_h100

Cost model: projected speed-up = L x T_plain / (T_forward(n) + T_verify(n) +
T_draft + T_other(n)), with L the acceptance length (tokens per step per
request) measured on our trained tiny head on the H100, T_plain the plain
decode step, and the step phases of a B-request step verifying n nodes
measured on the 8B shape (integration/v1/tree_profile.py; T_other = step time -
the three phases: scheduling, input preparation, output processing). The
drafting cost of a configuration comes from our head runtime measured alone
on the 8B-shaped head: ingest + the drafting pass eager, and ingest + the
pass replayed as a captured CUDA graph (what the runtime does on CUDA).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIGS = {  # tiny method -> (nodes verified, topk, head steps, shape)
    **{f"chain K={k}": (k + 1, 1, k, "chain") for k in range(1, 9)},
    "ours tree 8": (8, 4, 4, "tree"), "ours tree 16": (16, 4, 4, "tree"),
    "ours tree 32": (32, 4, 8, "tree"), "ours tree 64": (64, 8, 8, "tree"),
}


def acceptance(tiny: list[dict]) -> dict[str, float]:
    """Tokens per step per request of each configuration, batched run; a
    chain at every K up to the longest chain run, from its per-position
    acceptance (a chain's first K drafts do not depend on how many follow)."""
    by_name = {r["method"]: r["batched"]["counts"] for r in tiny}
    lengths = {name: 1 + c["num_accepted_tokens"] / c["num_drafts"]
               for name, c in by_name.items() if c["num_drafts"]}
    chains = [c for name, c in by_name.items() if name.startswith("ours chain")
              and c["num_drafts"]]
    if chains:
        longest = max(chains, key=lambda c: len(c["accepted_per_pos"]))
        rates = [a / longest["num_drafts"] for a in longest["accepted_per_pos"]]
        for k in range(1, len(rates) + 1):
            lengths[f"chain K={k}"] = 1 + sum(rates[:k])
    return lengths


def phase_costs(sweep: list[dict]) -> dict[tuple, dict]:
    """{(shape, nodes, batch): {forward_s, verify_s, draft_s, step_s, other_s}}."""
    costs = {}
    for row in sweep:
        if "num_nodes" not in row or row["step_s"] is None:
            continue
        other = row["step_s"] - row["forward_s"] - row["verify_s"] - row["draft_s"]
        costs[(row["shape"], row["num_nodes"], row["batch_size"])] = {**row, "other_s": other}
    return costs


def draft_costs(head_rows: list[dict]) -> dict[tuple, dict]:
    """{(topk, steps, nodes, batch): {as_run_s, graphed_s}}: our head runtime's
    drafting eager (ingest + eager drafting pass) and as it runs on CUDA
    (ingest + the pass replayed as one captured graph: `draft_graph_s`; runs
    from before the runtime captured passes recorded one graphed expansion
    step instead, `step_graph_s`, counted num_steps times; the ingest is
    the graphed one, `ingest_graph_s`, in runs that measured it)."""
    costs = {}
    for r in head_rows:
        graphed = r.get("draft_graph_s")
        if graphed is None and r.get("step_graph_s") is not None:
            graphed = r["num_steps"] * r["step_graph_s"]
        ingest = r.get("ingest_graph_s") or r["ingest_s"]  # graphed ingest where measured
        costs[(r["topk"], r["num_steps"], r["num_nodes"], r["batch_size"])] = {
            "as_run_s": r["ingest_s"] + r["draft_s"],
            "graphed_s": None if graphed is None else ingest + graphed}
    return costs


def projections(lengths, costs, plain, drafts) -> list[dict]:
    rows = []
    for name, (nodes, topk, steps, shape) in CONFIGS.items():
        for batch, plain_s in plain.items():
            cost, draft = costs.get((shape, nodes, batch)), drafts.get((topk, steps, nodes, batch))
            if name not in lengths or cost is None or draft is None:
                continue
            target = cost["forward_s"] + cost["verify_s"] + cost["other_s"]
            row = {"config": name, "nodes": nodes, "batch_size": batch,
                   "acceptance_length": lengths[name], "plain_s": plain_s, "target_s": target}
            for kind in ("as_run", "graphed"):
                if draft[f"{kind}_s"] is not None:
                    step = target + draft[f"{kind}_s"]
                    row[f"{kind}_draft_s"] = draft[f"{kind}_s"]
                    row[f"{kind}_speedup"] = lengths[name] * plain_s / step
            rows.append(row)
    return rows


TINY_NAME = {"chain K=5": "chain K=5", "tree 16": "ours tree 16", "tree 32": "ours tree 32"}
MTP_NAME = {"chain K=5": "ours-chain-k5", "tree 16": "ours-tree16-topk4-T0.25",
            "tree 32": "ours-tree32-topk4-T0.25"}  # same shapes as the engine configurations


def mtp_acceptance(path: Path) -> dict[str, float]:
    """Acceptance lengths of the tiny MTP model (`docs/results/mtp_tiny/
    offline.json`, benchmarks/bench_mtp.py), under the names
    `engine_projections` looks up."""
    rows = {r["name"]: r["counts"]["mean_acceptance_length"]
            for r in json.loads(path.read_text())["rows"]}
    return {TINY_NAME[config]: rows[name] for config, name in MTP_NAME.items()
            if rows.get(name)}


def engine_projections(lengths, config_rows: list[dict], plain) -> list[dict]:
    """One engine per configuration (`--parts configs`): its measured decode
    step (target forward, verification, drafting as the engine runs it, the
    rest) and L x T_plain / that step."""
    rows = []
    for c in config_rows:
        length, plain_s = lengths.get(TINY_NAME.get(c["config"], "")), plain.get(c["batch_size"])
        if length is None or plain_s is None or c["step_s"] is None:
            continue
        rows.append({**c, "acceptance_length": length, "plain_s": plain_s,
                     "other_s": c["step_s"] - c["forward_s"] - c["verify_s"] - c["draft_s"],
                     "speedup": length * plain_s / c["step_s"]})
    return rows


def engine_check(rows: list[dict], engine_rows: list[dict]) -> list[dict]:
    """The model's projection for a configuration (target phases from the
    node-count sweep + our head runtime measured alone, graphed) against the
    same configuration's own engine (`--parts configs`), same acceptance
    length: the error is that of the modelled step time."""
    by_key = {(r["config"], r["batch_size"]): r for r in rows}
    checks = []
    for e in engine_rows:
        model = by_key.get((TINY_NAME.get(e["config"], e["config"]), e["batch_size"]))
        if model is None or "graphed_speedup" not in model:
            continue
        checks.append({"run": f"{e['config']} (8B shape, model vs its engine)",
                       "batch_size": e["batch_size"], "predicted": model["graphed_speedup"],
                       "measured": e["speedup"],
                       "error": model["graphed_speedup"] / e["speedup"] - 1})
    return checks


def ngram_check(ngram_rows: list[dict], costs, plain) -> list[dict]:
    """n-gram on the 8B shape (issue 11's measured run, K=5: 6 nodes, no head):
    projected from our chain-6 step costs without drafting vs measured."""
    checks = []
    for row in ngram_rows:
        if row["method"] not in ("specplug_ngram", "vllm ngram"):
            continue
        cost, plain_s = costs.get(("chain", 6, row["batch_size"])), plain.get(row["batch_size"])
        if cost is None or plain_s is None:
            continue
        step = cost["forward_s"] + cost["verify_s"] + cost["other_s"]
        predicted = row["tokens_per_step"] * plain_s / step
        checks.append({"run": f"{row['method']} (8B shape)", "batch_size": row["batch_size"],
                       "predicted": predicted, "measured": row["speedup"],
                       "error": predicted / row["speedup"] - 1})
    return checks


def _phases_for(row: dict, tiny: list[dict], mode: str) -> list[dict]:
    """The row's own step phases; for vLLM's eagle3 (no phases: it runs on
    Model Runner V2) those of our chain of the same K, the model's costs."""
    spec = row.get("spec") or {}
    if spec.get("method") == "eagle3":
        k = spec.get("num_speculative_tokens")
        row = next((r for r in tiny if r["method"] == f"ours chain K={k}"), row)
    return [p for p in row[mode]["phases"] if p["step_s"]]


def tiny_check(tiny: list[dict]) -> list[dict]:
    """Runs on the tiny model: L x T_plain / median measured step vs the
    end-to-end tokens/s ratio of the same run (batch 60 and alone). vLLM's
    eagle3 is predicted with our chain's step of the same K: its error is
    the difference of the two runners' steps."""
    base = next(r for r in tiny if r["method"] == "none")
    checks = []
    for row in tiny:
        for mode, batch in (("batched", len(row["batched"]["token_ids"])), ("alone", 1)):
            phases = _phases_for(row, tiny, mode)
            counts = row[mode]["counts"]
            if not phases or not counts["num_drafts"]:
                continue
            steps = sorted(p["step_s"] for p in phases if p["num_reqs"] == batch)
            if not steps:
                continue
            plain = batch / base[mode]["tokens_per_second"]
            length = 1 + counts["num_accepted_tokens"] / counts["num_drafts"]
            predicted = length * plain / steps[len(steps) // 2]
            measured = row[mode]["tokens_per_second"] / base[mode]["tokens_per_second"]
            checks.append({"run": f"{row['method']} (tiny)", "batch_size": batch,
                           "predicted": predicted, "measured": measured,
                           "error": predicted / measured - 1})
    return checks


def main() -> None:
    from tree_cost_report import write_report

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--ngram", type=Path, default=Path(
        "docs/results/model_runner_v2_h100.json"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mtp", type=Path, default=Path("docs/results/mtp_tiny/offline.json"),
                        help="acceptance lengths of the tiny MTP model (CPU run)")
    parser.add_argument("--sweep-from", type=Path, default=None,
                        help="a tree_costs_8b.json whose node-count sweep to use when "
                             "--results has none (the sweep takes a device call of its own)")
    args = parser.parse_args()
    tiny = json.loads((args.results / "tree_tiny.json").read_text())
    cost_run = json.loads((args.results / "tree_costs_8b.json").read_text())[0]
    plain = {r["batch_size"]: r["step_s"] for r in cost_run["plain"]}
    sweep = cost_run.get("sweep")
    if sweep is None and args.sweep_from is not None:
        sweep = json.loads(args.sweep_from.read_text())[0]["sweep"]
    costs = phase_costs(sweep or [])
    lengths = acceptance(tiny)
    drafts = draft_costs(cost_run.get("head", []))
    ngram = json.loads(args.ngram.read_text())["llama3-8b-shape"] if args.ngram.exists() else []
    rows = projections(lengths, costs, plain, drafts)
    engine_rows = engine_projections(lengths, cost_run.get("configs", []), plain)
    mtp_rows = (engine_projections(mtp_acceptance(args.mtp), cost_run.get("configs", []),
                                   plain) if args.mtp.exists() else [])
    write_report(args.out, tiny, plain, costs, cost_run.get("head", []), rows,
                 engine_check(rows, engine_rows) + ngram_check(ngram, costs, plain)
                 + tiny_check(tiny), engine_rows, mtp_rows)


if __name__ == "__main__":
    main()
