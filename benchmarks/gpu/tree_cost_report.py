"""Text, JSON and PNG of the tree-on-CUDA results (tree_cost_model.py computes)."""
from __future__ import annotations

import json
from pathlib import Path

MS = 1000.0
MTP_SOURCE = ("MTP acceptance (the tiny MTP model, CPU run, outputs exact; the step costs "
              "are those of the EAGLE-3-shaped head, whose draft vocabulary is 32k: an MTP "
              "layer reads the target's 128k-row lm_head each step, more)")


def _differences(base: dict, row: dict, mode: str) -> str:
    """Where each differing output first departs from no speculation, with
    the no-speculation run's top-2 log-prob gap there (a tiny gap: a
    floating-point tie that another batch shape's rounding can flip)."""
    from vllm_specplug.bench.compare import divergences

    if "gaps" not in base:
        return ""
    found = divergences(base[mode]["token_ids"], row[mode]["token_ids"], base["gaps"])
    return "".join(f"; #{d['request']}@{d['position']} gap {d['gap']:.1e}" for d in found)


def _tiny_table(tiny: list[dict]) -> list[str]:
    base = next(r for r in tiny if r["method"] == "none")
    lines = ["## Tiny model + built-in head on the H100 (fp32, 60 held-out prompts, 64 tokens)",
             "| method | batched: equal to none | alone: equal | accept len | tok/s batch 60 "
             "| vs none | tok/s alone | vs none | forward / verify / draft / step ms (batched) "
             "| decode steps in FULL graphs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in tiny:
        cells = [row["method"]]
        for mode in ("batched", "alone"):
            same = sum(a == b for a, b in zip(base[mode]["token_ids"], row[mode]["token_ids"]))
            cells.append(f"{same}/{len(base[mode]['token_ids'])}"
                         + _differences(base, row, mode))
        counts = row["batched"]["counts"]
        accept = 1 + counts["num_accepted_tokens"] / max(counts["num_drafts"], 1)
        cells.append(f"{accept:.2f}")
        for mode in ("batched", "alone"):
            tps = row[mode]["tokens_per_second"]
            cells += [f"{tps:.0f}", f"{tps / base[mode]['tokens_per_second']:.2f}x"]
        phases = [p for p in row["batched"]["phases"] if p["step_s"]]
        cells.append(" / ".join(f"{MS * _median([p[k] for p in phases]):.2f}" for k in
                                ("forward_s", "verify_s", "draft_s", "step_s"))
                     if phases else "-")
        cells.append(_full_share(row))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _full_share(row: dict) -> str:
    """Share of the uniform decode steps (every request verifies its whole
    tree or chain: tokens a multiple of the nodes per request) that replayed
    a FULL CUDA graph."""
    spec = row.get("spec") or {}
    nodes = spec.get("num_draft_tokens") or 1 + spec.get("num_speculative_tokens", 0)
    uniform = [m for m in row["cudagraph_modes"] if m["num_tokens"] % nodes == 0]
    total = sum(m["count"] for m in uniform)
    full = sum(m["count"] for m in uniform if "FULL" in str(m["mode"]))
    return f"{full}/{total}" if total else "-"


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _cost_table(plain: dict, costs: dict) -> list[str]:
    lines = ["## Step costs, Llama-3-8B shape (bf16 dummy weights, FlashAttention; "
             "random EAGLE-3 head; ms, median of decode steps)",
             "| batch | plain decode | verify shape | nodes | forward | verify+compaction "
             "| draft in the engine (64-node trees) | other | step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (shape, nodes, batch), c in sorted(costs.items(), key=lambda kv: (kv[0][2], kv[0][0],
                                                                          kv[0][1])):
        lines.append(f"| {batch} | {MS * plain.get(batch, float('nan')):.2f} | {shape} | "
                     f"{nodes} | {MS * c['forward_s']:.2f} | {MS * c['verify_s']:.2f} | "
                     f"{MS * c['draft_s']:.2f} | {MS * c['other_s']:.2f} | "
                     f"{MS * c['step_s']:.2f} |")
    return lines


def _head_table(head_rows: list[dict]) -> list[str]:
    """Newer runs time the whole drafting pass as the runtime's CUDA graph
    (`draft_graph_s`); older ones one graphed expansion step (`step_graph_s`)."""
    whole = any("draft_graph_s" in r for r in head_rows)
    graph_label = "whole draft, CUDA graph" if whole else "one step, CUDA graph"
    dtypes = ", ".join(sorted({r.get("dtype", "float32") for r in head_rows}))
    lines = [f"## Our head runtime alone, 8B-shaped EAGLE-3 head ({dtypes}, 512 cached "
             "positions; ms)",
             "| batch | topk | head steps | nodes | ingest (1 position), eager | ingest, "
             f"CUDA graph | one step, eager | whole draft, eager | {graph_label} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in head_rows:
        value = r.get("draft_graph_s" if whole else "step_graph_s")
        graphed = "-" if value is None else f"{MS * value:.2f}"
        ingest = "-" if r.get("ingest_graph_s") is None else f"{MS * r['ingest_graph_s']:.2f}"
        lines.append(f"| {r['batch_size']} | {r['topk']} | {r['num_steps']} | "
                     f"{r['num_nodes']} | {MS * r['ingest_s']:.2f} | {ingest} | "
                     f"{MS * r['step_eager_s']:.2f} | {MS * r['draft_s']:.2f} | {graphed} |")
    return lines


def _best(rows: list[dict], batch: int, kind: str, tree: bool):
    key = f"{kind}_speedup"
    at = [r for r in rows if r["batch_size"] == batch and key in r
          and ("tree" in r["config"]) == tree]
    return max(at, key=lambda r: r[key], default=None)


def _projection_table(rows: list[dict]) -> list[str]:
    lines = ["## Projected speed-up on the 8B shape (acceptance of the tiny head)",
             "| config | nodes | batch | accept len | target step ms | draft ms as run "
             "| speed-up as run | draft ms graphed | speed-up graphed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["config"], str(r["nodes"]), str(r["batch_size"]),
                 f"{r['acceptance_length']:.2f}", f"{MS * r['target_s']:.2f}"]
        for kind in ("as_run", "graphed"):
            has = f"{kind}_speedup" in r
            cells += [f"{MS * r[f'{kind}_draft_s']:.2f}" if has else "-",
                      f"{r[f'{kind}_speedup']:.2f}x" if has else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Best chain vs best tree per batch size (speed-up over no speculation):"]
    for kind in ("as_run", "graphed"):
        for batch in sorted({r["batch_size"] for r in rows}):
            chain, tree = _best(rows, batch, kind, False), _best(rows, batch, kind, True)
            if chain and tree:
                key = f"{kind}_speedup"
                lines.append(f"- {kind}, batch {batch}: {chain['config']} {chain[key]:.2f}x, "
                             f"{tree['config']} {tree[key]:.2f}x, tree/chain "
                             f"{tree[key] / chain[key]:.2f}")
    return lines


def _engine_table(rows: list[dict], source: str = "tiny") -> list[str]:
    if not rows:
        return []
    lines = ["## One engine per configuration, 8B shape (its own capture sizes; drafting "
             f"passes replayed as CUDA graphs; ms, median of decode steps): {source}",
             f"| config | batch | accept len ({source.split(' ')[0]}) | plain | forward | verify+compaction "
             "| draft | other | step | projected speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['batch_size']} | {r['acceptance_length']:.2f} | "
                     + " | ".join(f"{MS * r[k]:.2f}" for k in
                                  ("plain_s", "forward_s", "verify_s", "draft_s", "other_s",
                                   "step_s")) + f" | {r['speedup']:.2f}x |")
    for batch in sorted({r["batch_size"] for r in rows}):
        by = {r["config"]: r["speedup"] for r in rows if r["batch_size"] == batch}
        chain, tree = by.get("chain K=5"), max((v for k, v in by.items() if "tree" in k),
                                               default=None)
        if chain and tree:
            lines.append(f"- batch {batch}: best tree / chain K=5 = {tree / chain:.2f}")
    return lines


def _check_table(checks: list[dict]) -> list[str]:
    lines = ["## The cost model against measured runs",
             "| run | batch | predicted | measured | error |", "|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['run']} | {c['batch_size']} | {c['predicted']:.2f}x | "
                     f"{c['measured']:.2f}x | {100 * c['error']:+.1f}% |")
    return lines


ENGINE_COLORS = {"chain K=5": "C4", "tree 16": "C5", "tree 32": "C6"}  # as their projected lines


def _plot(out: Path, costs: dict, rows: list[dict], engine_rows=(), mtp_rows=()) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for color, batch in zip(("C0", "C1", "C2"), sorted({k[2] for k in costs})):
        for shape, style in (("chain", "-o"), ("tree", "--s")):
            points = sorted((k[1], c["forward_s"] + c["verify_s"]) for k, c in costs.items()
                            if k[0] == shape and k[2] == batch)
            if points:
                left.plot([p[0] for p in points], [MS * p[1] for p in points], style,
                          color=color, label=f"{shape}, batch {batch}")
    left.set(xscale="log", xlabel="nodes verified per request", ylabel="ms per step",
             title="8B shape: target forward + verification")
    left.set_xticks([2, 4, 8, 16, 32, 64], labels=["2", "4", "8", "16", "32", "64"])
    left.minorticks_off()
    left.legend(fontsize=7)
    for config in sorted({r["config"] for r in rows}, key=lambda c: (c[0], len(c), c)):
        points = sorted((r["batch_size"], r["graphed_speedup"]) for r in rows
                        if r["config"] == config and "graphed_speedup" in r)
        if not points:
            continue
        right.plot([p[0] for p in points], [p[1] for p in points],
                   "--" if "tree" in config else "-", marker=".", label=config)
    for engine, marker, source in ((engine_rows, "X", "engine, tiny L"),
                                   (mtp_rows, "D", "engine, MTP L")):
        for config in sorted({r["config"] for r in engine}):
            points = sorted((r["batch_size"], r["speedup"]) for r in engine
                            if r["config"] == config)
            right.plot([p[0] for p in points], [p[1] for p in points], marker, ls=":",
                       color=ENGINE_COLORS.get(config), label=f"{config} ({source})")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xscale="log", xlabel="batch size", ylabel="projected speed-up",
              title="8B shape: projected (lines), engine-measured steps (markers)")
    right.set_xticks([1, 16, 64], labels=["1", "16", "64"])
    right.minorticks_off()
    right.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def write_report(out: Path, tiny, plain, costs, head_rows, rows, checks,
                 engine_rows=(), mtp_rows=()) -> None:
    """mtp_rows: the engine rows again with the MTP model's acceptance lengths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(_tiny_table(tiny) + [""] + _cost_table(plain, costs) + [""]
                     + _head_table(head_rows) + [""] + _projection_table(rows) + [""]
                     + _engine_table(list(engine_rows), "tiny EAGLE-3 head") + [""]
                     + _engine_table(list(mtp_rows), MTP_SOURCE) + [""]
                     + _check_table(checks)) + "\n"
    out.with_suffix(".txt").write_text(text)
    slim = [{k: v for k, v in r.items() if k not in ("batched", "alone", "gaps")}
            | {m: {k: v for k, v in r[m].items() if k != "token_ids"}
               for m in ("batched", "alone")} for r in tiny]
    out.with_suffix(".json").write_text(json.dumps(
        {"tiny": slim, "plain_s": plain, "costs": [dict(c) for c in costs.values()],
         "head": head_rows,
         "projections": rows, "engine_projections": list(engine_rows),
         "engine_projections_mtp": list(mtp_rows),
         "checks": checks}, indent=1))
    _plot(out, costs, rows, list(engine_rows), list(mtp_rows))
    print(text)
