"""Per-repeat ratios between rows of a `bench offline` result (its JSON).

On a noisy host a whole repeat runs fast or slow (the H200 here moved 3x
within one engine), and every row of an interleaved repeat shares it: one
row over another is taken within each repeat, then its median and range
reported, as `bench offline` does for a row over no speculation. The
reference may be several rows: per repeat, the fastest of them (the best
static configuration, or vLLM's best length, in that repeat).
"""
from __future__ import annotations

import json
from pathlib import Path

from vllm_specplug.bench.report import spread


def load_rows(path: str | Path) -> list[dict]:
    """The rows of a `bench offline` JSON (`offline.json`), with a clear
    error naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        rows = data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a `bench offline` result JSON ({error}); pass the "
                         "offline.json that `bench offline --out DIR` wrote") from error
    return rows


def repeat_ratios(rows: list[dict], name: str, over: list[str], batch_size: int
                  ) -> list[float] | None:
    """[repeats] `name`'s tokens/s over the fastest of `over` in each repeat
    at `batch_size`; None where a row is missing there or its repeats do not
    line up (a failed row has none)."""
    by_name = {r["name"]: r for r in rows if r["batch_size"] == batch_size}
    if name not in by_name or any(o not in by_name for o in over):
        return None
    mine = by_name[name]["tokens_per_second"]
    theirs = [by_name[o]["tokens_per_second"] for o in over]
    if not mine or any(len(t) != len(mine) for t in theirs):
        return None
    return [m / max(t[i] for t in theirs) for i, m in enumerate(mine)]


def ratio_table(rows: list[dict], over: list[str], names: list[str] | None = None) -> str:
    """One line per row and batch size: median [min-max] of its per-repeat
    ratio over `over` (the fastest of them per repeat), and the repeats."""
    known = {r["name"] for r in rows}
    missing = [o for o in over if o not in known]
    if missing:
        raise ValueError(f"--over {', '.join(missing)}: no such row; rows are "
                         f"{', '.join(sorted(known))}")
    names = names or [n for n in dict.fromkeys(r["name"] for r in rows) if n not in over]
    sizes = sorted({r["batch_size"] for r in rows})
    title = f"over {' / '.join(over)}" + (" (the fastest per repeat)" if len(over) > 1 else "")
    lines = [f"{'row':28}{'batch':>6}  {title}", "-" * 78]
    for name in names:
        for size in sizes:
            ratios = repeat_ratios(rows, name, over, size)
            if ratios:
                lines.append(f"{name:28}{size:>6}  {spread(ratios, '.2f')}   per repeat: "
                             + " ".join(f"{r:.2f}" for r in ratios))
    return "\n".join(lines)
