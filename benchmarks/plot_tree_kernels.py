"""Plot a bench_tree_kernels.py JSON: kernel vs reference time over batch size.

    python benchmarks/plot_tree_kernels.py docs/results/tree_kernels_h200.json out.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [("tree_build", 16, None), ("verify_greedy", 16, 128256),
          ("verify_stochastic", 16, 128256), ("kv_compaction_32L", 16, None),
          ("chain_rejection", 5, 128256)]


def main(path: str, out: str) -> None:
    results = json.load(open(path))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.6), sharey=True)
    for ax, (kernel, nodes, vocab) in zip(axes, PANELS):
        by_batch = {r["batch"]: r for r in results["rows"] if r["kernel"] == kernel
                    and r["nodes"] == nodes and r["vocab"] == vocab}  # last run wins
        rows = [by_batch[b] for b in sorted(by_batch)]
        batches = [r["batch"] for r in rows]
        for key, label in (("kernel_us", "Triton (graph)"), ("eager_us", "Triton (eager)"),
                           ("reference_us", "PyTorch reference")):
            ax.plot(batches, [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch",
               title=f"{kernel}\nnodes {nodes}" + (f", vocab {vocab}" if vocab else ""))
    axes[0].set_ylabel("median us per call")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{results['device']}, torch {results['torch']}, triton {results['triton']}, "
                 f"{results['date']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
