"""SmolLM2's EAGLE-3 heads: acceptance length and agreement against the
amount of training data (issue 25's "measured curve").

    python benchmarks/plot_tau_vs_data.py docs/results/smollm2_tau_vs_data

Reads `points.json` in that folder and writes `tau_vs_data.png` and
`tau_vs_data.txt` beside it, with a log-linear fit of the chain's τ per
decade of tokens.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def fit_per_decade(points: list[dict], key: str) -> tuple[float, float]:
    """Least squares τ = a + b * log10(tokens) over the points that have `key`."""
    xs = [math.log10(p["num_train_tokens"]) for p in points if p.get(key)]
    ys = [p[key] for p in points if p.get(key)]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    return mean_y - slope * mean_x, slope


def table(points: list[dict], fit: tuple[float, float]) -> str:
    lines = [f"{'head':<22}{'tokens':>10}  agreement (pos 1/2/3)  τ vLLM K5  τ chain K5  τ tree16"]
    for p in points:
        agreement = " / ".join(f"{a:.2f}" for a in p["agreement"])
        tree = f"{p['tau_tree16']:.2f}" if p.get("tau_tree16") else "-"
        lines.append(f"{p['head']:<22}{p['num_train_tokens']:>10}  {agreement:<21}  "
                     f"{p['tau_vllm_eagle3_k5']:>9.2f}  {p['tau_chain_k5']:>10.2f}  {tree:>8}")
    a, b = fit
    needed = 10 ** ((3.5 - a) / b)
    lines.append(f"\nchain τ = {a:.2f} + {b:.3f} * log10(tokens); at this slope τ 3.5 needs "
                 f"about 10^{math.log10(needed):.1f} tokens")
    return "\n".join(lines)


def plot(points: list[dict], fit: tuple[float, float], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = [p["num_train_tokens"] for p in points]
    for key, label in (("tau_vllm_eagle3_k5", "vLLM eagle3 K=5"),
                       ("tau_chain_k5", "our chain K=5"), ("tau_tree16", "our tree 16")):
        pts = [(p["num_train_tokens"], p[key]) for p in points if p.get(key)]
        left.plot(*zip(*pts), marker="o", label=label)
    a, b = fit
    xs = [min(tokens), max(tokens)]
    left.plot(xs, [a + b * math.log10(x) for x in xs], "k:", label=f"fit: +{b:.2f} per decade")
    left.set(xscale="log", xlabel="training tokens", ylabel="MT-Bench acceptance length τ",
             title="τ against data (target: chain 3.5)")
    left.legend()
    for position in range(3):
        right.plot(tokens, [p["agreement"][position] for p in points], marker="o",
                   label=f"position {position + 1}")
    right.set(xscale="log", xlabel="training tokens", ylabel="held-out top-1 agreement",
              title="agreement with SmolLM2")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(folder: str) -> int:
    root = Path(folder)
    points = sorted(json.loads((root / "points.json").read_text())["points"],
                    key=lambda p: p["num_train_tokens"])
    fit = fit_per_decade(points, "tau_chain_k5")
    text = table(points, fit)
    (root / "tau_vs_data.txt").write_text(text + "\n")
    plot(points, fit, root / "tau_vs_data.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/results/smollm2_tau_vs_data"))
