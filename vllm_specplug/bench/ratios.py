"""Per-repeat ratios between rows of a `bench offline` or `bench online`
result (its JSON).

On a noisy host a whole repeat runs fast or slow (the H200 here moved 3x
within one engine), and every row of an interleaved repeat shares it: one
row over another is taken within each repeat, then its median and range
reported, as `bench offline` does for a row over no speculation. The
reference may be several rows: per repeat, the fastest of them (the best
static configuration, or vLLM's best length, in that repeat).

`decode=True` compares each repeat's decode time instead of its tokens/s
(an offline row's `repeats[i]["decode_ms"]`: its waves' first token to
last, engine timestamps; bench/waves.py): on a host-bound GPU the tokens/s
of one row moved 0.63-1.55x another's between repeats
(docs/results/smollm2_sets_h200_s57), and tokens/s also counts each wave's
prefill and the front end's work.
"""
from __future__ import annotations

import json
from pathlib import Path

from vllm_specplug.bench.report import spread


def load_rows(path: str | Path) -> list[dict]:
    """The rows of a `bench offline` JSON (`offline.json`: a row per batch
    size, its repeats in a list) or of a `bench online` one (`online.json`,
    `ramp.json`: a row per repeat, folded here into the offline shape, the
    load or concurrency as its `batch_size`), with a clear error naming the
    file when it is neither."""
    try:
        data = json.loads(Path(path).read_text())
        rows = data["rows"]
        if rows and "batch_size" not in rows[0]:
            rows = fold_online_rows(rows)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a `bench offline` or `bench online` result JSON "
                         f"({error}); pass the offline.json, online.json or ramp.json "
                         "that `bench offline/online --out DIR` wrote") from error
    return rows


def fold_online_rows(rows: list[dict]) -> list[dict]:
    """`bench online` rows (one per server, load and repeat) as offline rows:
    one per server and load, `tokens_per_second` its repeats in order. The
    load is a ramp's name ("ramp 1-256-1") or the concurrency."""
    folded: dict[tuple[str, object], dict] = {}
    for row in sorted(rows, key=lambda r: r.get("repeat", 0)):
        # a steady load's rows differ by concurrency (bench/online.OnlineRow.load)
        load = row["concurrency"] if row.get("load", "steady") == "steady" else row["load"]
        entry = folded.setdefault((row["name"], load), {
            "name": row["name"], "batch_size": load, "tokens_per_second": []})
        ok = row.get("num_failed") == 0 and row["seconds"] > 0
        entry["tokens_per_second"].append(row["num_output_tokens"] / row["seconds"] if ok
                                          else None)
    for entry in folded.values():
        if None in entry["tokens_per_second"]:
            entry["tokens_per_second"] = []  # a failed repeat: no ratios for this row
    return list(folded.values())


def set_rows(rows: list[dict], prompt_set: str | None) -> list[dict]:
    """The rows of one prompt set (`bench offline --prompts A --prompts B`
    runs each set on the same engines, rows of the same name and batch);
    a result of one set needs none named."""
    sets = list(dict.fromkeys(r.get("prompt_set", "") for r in rows))
    if prompt_set is None:
        if len(sets) > 1:
            raise ValueError(f"this result holds the prompt sets {', '.join(sets)}: "
                             "pick one with --prompt-set NAME")
        return rows
    if prompt_set not in sets:
        raise ValueError(f"--prompt-set {prompt_set}: not in this result; its sets are "
                         f"{', '.join(s or '(one, unnamed)' for s in sets)}")
    return [r for r in rows if r.get("prompt_set", "") == prompt_set]


def repeat_speeds(row: dict, decode: bool = False) -> list[float]:
    """[repeats] a row's speed in each repeat: its tokens/s, or with `decode`
    the inverse of its decode time (1 / s), up to the first repeat without
    one (results written before it was recorded, online rows: none)."""
    if not decode:
        return row["tokens_per_second"]
    speeds = []
    for record in row.get("repeats", []):
        if not record.get("decode_ms"):
            break
        speeds.append(1e3 / record["decode_ms"])
    return speeds


def repeat_ratios(rows: list[dict], name: str, over: list[str], batch_size: int,
                  decode: bool = False) -> list[float] | None:
    """[repeats] `name`'s speed over the fastest of `over` in each repeat at
    `batch_size` (tokens/s, or with `decode` the decode time's inverse:
    `repeat_speeds`), over the repeats every one of them has (a run cut
    short, `offline.partial.json`, ends with a repeat some rows lack:
    interleaved repeat i ran for every row before repeat i + 1 began); None
    where a row is missing there or has no repeat (a failed row)."""
    by_name = {r["name"]: r for r in rows if r["batch_size"] == batch_size}
    if name not in by_name or any(o not in by_name for o in over):
        return None
    mine = repeat_speeds(by_name[name], decode)
    theirs = [repeat_speeds(by_name[o], decode) for o in over]
    num_repeats = min(len(t) for t in [mine, *theirs])
    if not num_repeats:
        return None
    return [mine[i] / max(t[i] for t in theirs) for i in range(num_repeats)]


def ratio_table(rows: list[dict], over: list[str], names: list[str] | None = None,
                decode: bool = False) -> str:
    """One line per row and batch size: median [min-max] of its per-repeat
    ratio over `over` (the fastest of them per repeat), and the repeats;
    `decode`: of the decode times' inverses (`repeat_speeds`)."""
    known = {r["name"] for r in rows}
    missing = [o for o in over if o not in known]
    if missing:
        raise ValueError(f"--over {', '.join(missing)}: no such row; rows are "
                         f"{', '.join(sorted(known))}")
    if decode and not any(repeat_speeds(r, decode) for r in rows):
        raise ValueError("--decode: no row of this result has its repeats' decode times "
                         "(`bench offline` records them since 2026-12-04; `bench online` "
                         "does not); compare tokens/s without --decode")
    names = names or [n for n in dict.fromkeys(r["name"] for r in rows) if n not in over]
    sizes = sorted({r["batch_size"] for r in rows}, key=lambda s: (isinstance(s, str), s))
    title = (f"{'decode speed ' if decode else ''}over {' / '.join(over)}"
             + (" (the fastest per repeat)" if len(over) > 1 else ""))
    width = max(6, *(len(str(s)) for s in sizes))
    lines = [f"{'row':28}{'batch':>{width}}  {title}", "-" * (72 + width)]
    for name in names:
        for size in sizes:
            ratios = repeat_ratios(rows, name, over, size, decode)
            if ratios:
                lines.append(f"{name:28}{size!s:>{width}}  {spread(ratios, '.2f')}   per repeat: "
                             + " ".join(f"{r:.2f}" for r in ratios))
    return "\n".join(lines)
