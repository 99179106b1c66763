"""Training curve: held-out top-1 agreement per unrolled step (PNG)."""
from __future__ import annotations

from pathlib import Path


def plot_agreement(history: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [record["step"] for record in history]
    num_ttt = len(history[0]["agreement"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for k in range(num_ttt):
        ax.plot(steps, [r["agreement"][k] for r in history], marker="o", markersize=3,
                label=f"draft position {k + 1}")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out top-1 agreement with target")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "EAGLE-3 head training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
