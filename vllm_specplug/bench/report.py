"""Tables, JSON and PNG plots of `vllm-specplug bench` results."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from functools import reduce
from operator import add
from pathlib import Path

from vllm_specplug.adaptive.batch_draft_stats import STEP_KINDS
from vllm_specplug.bench.compare import format_divergences_table
from vllm_specplug.metrics import SpecDecodeCounts


def _exact_text(num_mismatches: int | None, num_near_ties: int | None = None,
                kind: str = "tie") -> str:
    """yes; tie(n): every difference first comes at a near-tie of the
    baseline (kind "ref", online: in a request where the baseline alone
    differs, every other server agreeing: ref(n)); NO(n): n requests differ
    otherwise (+m explained so: +mt, +mr)."""
    if num_mismatches is None:
        return "-"
    if num_mismatches == 0:
        return "yes"
    ties = num_near_ties or 0
    if ties == num_mismatches:
        return f"{kind}({ties})"
    return f"NO({num_mismatches - ties})" + (f"+{ties}{kind[0]}" if ties else "")


def accepted_positions(counts: SpecDecodeCounts) -> list[float]:
    """Per-position acceptance up to the deepest position ever accepted (a
    tree of N nodes reports N - 1 positions; those past its depth stay 0)."""
    rates = list(counts.per_position_acceptance)
    while rates and rates[-1] == 0.0:
        rates.pop()
    return rates


def _acceptance_text(counts: SpecDecodeCounts) -> tuple[str, str]:
    if counts.num_drafts == 0:
        return "-", ""
    return (f"{counts.mean_acceptance_length:.2f}",
            " ".join(f"{p:.2f}" for p in accepted_positions(counts)))


def _ratio_text(row) -> str:
    """Median ratio to no speculation and, over several repeats, its range."""
    if math.isnan(row.speedup):
        return "-"
    ratios = getattr(row, "ratios", [])
    if len(ratios) < 2:
        return f"{row.speedup:.2f}"
    return f"{row.speedup:.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _engine_text(row) -> str:
    """`runner/speculator dtype`, as the engine's worker reported them."""
    engine = getattr(row, "engine", {}) or {}
    runner = (engine.get("runner") or "").rsplit(".", 2)
    where = runner[-2] if len(runner) > 1 else runner[0]
    dtype = engine.get("dtype")
    dtype = f" {DTYPE_SHORT.get(dtype, dtype)}" if dtype else ""
    return f"{where}/{engine.get('speculator') or '-'}{dtype}" if where else ""


def inexact_low_precision_rows(rows) -> list[str]:
    """Rows with greedy outputs unequal to no speculation's on an engine that
    ran below float32: rounding under a verify step's batch shape differs from
    one token a request, so these are not evidence of a lossy method
    (docs/bench.md, "bf16 is not exact, for anyone")."""
    return [f"{row.name} (batch {row.batch_size})" for row in rows
            if row.error is None and (row.num_mismatches or row.num_near_ties)
            and (getattr(row, "engine", {}) or {}).get("dtype", "float32") != "float32"]


def format_offline_table(rows) -> str:
    w = max([18] + [len(row.name) + 1 for row in rows])  # method column
    e = max([34] + [len(_engine_text(row)) + 2 for row in rows])  # runner/speculator column
    header = (f"{'method':<{w}}{'batch':>6}{'tok/s':>9}{'min':>9}{'x none [range]':>18}"
              f"{'accept len':>11}{'drafts':>8}{'exact':>8}  {'runner/speculator dtype':<{e}}"
              "per-position acceptance")
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.error is not None:
            lines.append(f"{row.name:<{w}}{row.batch_size:>6}  failed: {row.error[:90]}")
            continue
        length, per_pos = _acceptance_text(row.counts)
        lines.append(f"{row.name:<{w}}{row.batch_size:>6}{row.median_tokens_per_second:>9.1f}"
                     f"{row.min_tokens_per_second:>9.1f}{_ratio_text(row):>18}{length:>11}"
                     f"{row.counts.num_drafts:>8}"
                     f"{_exact_text(row.num_mismatches, row.num_near_ties):>8}  "
                     f"{_engine_text(row):<{e}}{per_pos}")
    tables = [t for t in (format_adaptive_table(rows), format_batch_policy_table(rows),
                          format_captures_table(rows), format_waves_table(rows),
                          format_step_periods_table(rows),
                          format_repeats_table(rows), format_divergences_table(rows)) if t]
    return "\n".join(lines + [line for t in tables for line in ("", t)])


def _decision_table(rows, field: str, title: str, columns: str, cells) -> str:
    """A table of a controller's decisions: one line per row where it ran
    (`field` set, no error), `cells(row)` after the name and batch size;
    "" when it ran nowhere."""
    ours = [r for r in rows if getattr(r, field, None) and r.error is None]
    if not ours:
        return ""
    w = max([len(title) + len(": method") + 2] + [len(row.name) + 1 for row in ours])
    header = f"{title + ': method':<{w}}{'batch':>6}{columns}"
    return "\n".join([header, "-" * len(header)]
                     + [f"{row.name:<{w}}{row.batch_size:>6}{cells(row)}" for row in ours])


def format_adaptive_table(rows) -> str:
    """The adaptive controller's decisions per row (rows where it ran)."""
    return _decision_table(
        rows, "adaptive", "adaptive", f"{'kept/offered':>16}{'per req':>9}{'cut to 0':>10}"
        f"{'accepted/expected':>20}{'step ms + ms/token':>22}", _adaptive_cells)


def _adaptive_cells(row) -> str:
    a = row.adaptive
    requests = max(a["num_requests"], 1)
    return (f"{a['num_kept']:>8}/{a['num_offered']:<7}"
            f"{a['mean_kept_per_request']:>9.2f}{a['num_zero'] / requests:>10.1%}"
            f"{a['num_accepted']:>10}/{a['expected_accepted']:<9.0f}"
            f"{a['cost_fixed_ms']:>12.3f} + {a['cost_per_token_ms']:.4f}")


def format_batch_policy_table(rows) -> str:
    """The batch draft length's decisions per row (rows where it ran): the
    share of steps each length was chosen for ("trying": steps that held
    another length to measure it), the explorations, the tokens per
    request it expected against those it got ("focused": weighings of a
    draining batch by its slowest request, with their mean ratio,
    adaptive/wave_focus.py), the seconds its steps took
    (pure decode at one length / changing length / with prefill tokens / the
    first after the engine idled, from its schedule), and
    the scheduler's own time in the policy per step; then, per length, the
    mean ms of its decode steps that it had priced, as taken against as
    expected."""
    return _decision_table(
        rows, "batch_policy", "batch draft length", f"{'steps':>7}{'explored':>10}"
        f"{'tokens/request expected/realised':>34}{'s decode/switch/mixed/first':>30}"
        f"{'policy us/step':>16}  chosen K: share of steps | K: step ms taken/expected",
        _policy_cells)


def _policy_cells(row) -> str:
    p = row.batch_policy
    steps, requests = max(p["num_steps"], 1), max(p["num_requests"], 1)
    chosen = " ".join(f"{k}:{n / steps:.0%}" for k, n in sorted(
        p["chosen"].items(), key=lambda item: int(item[0])) if n)
    trying = p["num_steps"] - sum(p["chosen"].values())
    chosen += f" trying:{trying / steps:.0%}" if trying > 0 else ""
    if p.get("num_focused"):  # weighings of a draining batch by its slowest request
        chosen += (f" focused:{p['num_focused']}"
                   f"(r {p['focus_ratio_sum'] / p['num_focused']:.2f})")
    tokens = f"{p['expected_tokens'] / requests:.2f}/{p['realised_tokens'] / requests:.2f}"
    seconds = "/".join(f"{p.get(kind + '_seconds', float('nan')):.2f}" for kind in STEP_KINDS)
    host = f"{1e6 * p.get('host_seconds', float('nan')) / steps:.0f}"
    return (f"{p['num_steps']:>7}{p['num_explored']:>10}{tokens:>34}{seconds:>30}{host:>16}"
            f"  {chosen}{_priced_cells(p)}")


def _priced_cells(policy: dict) -> str:
    """" | 0:70/90 5:131/81": per length, the mean ms of its priced decode
    steps as taken / as expected ("" before any; older records lack them)."""
    steps = policy.get("priced_steps") or {}
    cells = [f"{k}:{1e3 * policy['priced_seconds'][k] / n:.0f}/"
             f"{1e3 * policy['expected_seconds'][k] / n:.0f}"
             for k, n in sorted(steps.items(), key=lambda item: int(item[0])) if n]
    return f" | {' '.join(cells)}" if cells else ""


def format_captures_table(rows) -> str:
    """The head's graphs captured during the timed repeats, per row, and our
    kernels compiled then: each stalled its step (start-up captures and
    compiles what service is expected to meet, integration/v2/step_warmup.py,
    kernel_warmup.py)."""
    return _decision_table(
        rows, "graph_captures", "head graphs captured in service",
        f"{'captures':>10}{'seconds':>9}{'graphs held':>13}  our kernels compiled",
        _captures_cells)


def _captures_cells(row) -> str:
    c = row.graph_captures
    compiles = ", ".join(f"{name} {n}" for name, n in sorted(c.get("kernel_compiles", {}).items()))
    return (f"{c['num_captures']:>10}{c['capture_seconds']:>9.2f}{c['num_graphs']:>13}"
            f"  {compiles or 'none'}")


def format_waves_table(rows) -> str:
    """Each row's `generate` calls as waves (bench/waves.py): ms per wave of
    its first step (and the slowest wave's) and of its decoding, its tail
    (the wave's decoding over its median request's), and ms per wave from
    its first token to its last request's first and of its slowest
    request's own decoding."""
    from vllm_specplug.bench.waves import wave_cells

    return _decision_table(
        rows, "waves", "waves (engine timestamps)",
        f"{'waves':>7}{'first step ms':>16}{'max':>10}{'decode ms':>12}{'tail':>8}"
        f"{'last start':>13}{'slowest req':>14}",
        lambda row: wave_cells(row.waves))


def format_step_periods_table(rows) -> str:
    """Each row's step periods over its timed repeats (bench/step_periods.py),
    repeat by repeat: median, p99 and max ms a step, and the slow steps
    (over twice the median) with the ms they took beyond it."""
    from vllm_specplug.bench.step_periods import PERIOD_WIDTHS, SLOW, period_cells

    timed = [r for r in rows if any(r.step_periods) and r.error is None]
    return _decision_table(
        timed, "step_periods", "step periods (timed repeats; per repeat)",
        f"{'steps':>8}  " + "  ".join(h.ljust(w) for h, w in zip(
            ("median ms", "p99 ms", "max ms", f"over {SLOW:g}x"), PERIOD_WIDTHS))
        + "  their ms over the median",
        lambda row: period_cells(row.step_periods))


def format_repeats_table(rows) -> str:
    """Each speculating row's measured repeats one by one (bench/repeats.py):
    τ, verify steps, prefix-cache hit rate, our head's prefix hits adopted,
    missed and filled."""
    from vllm_specplug.bench.repeats import (REPEAT_HEADS, repeat_fields, repeat_line,
                                             repeat_widths)

    speculating = [r for r in rows if r.counts.num_drafts and r.repeats and r.error is None]
    if not speculating:
        return ""
    fields = {id(r): repeat_fields(r.repeats) for r in speculating}
    widths = repeat_widths(list(fields.values()))
    return _decision_table(speculating, "repeats", "by repeat", repeat_line(REPEAT_HEADS, widths),
                           lambda row: repeat_line(fields[id(row)], widths))


def format_step_kinds_table(rows) -> str:
    """The phases pass's steps by kind (bench/step_kinds.py): per kind, its
    steps and ms a step, from one step's start to the next's; "" where no
    row was probed."""
    from vllm_specplug.bench.step_kinds import STEP_KINDS, step_kind_cells

    probed = [r for r in rows if ((r.phases or {}).get("timed") or {}).get("step_kinds")]
    return _decision_table(
        probed, "phases", "steps by kind (phases pass)",
        "".join(f"{kind + ' steps':>13}{'ms':>7}" for kind in STEP_KINDS),
        lambda row: step_kind_cells(row.phases["timed"]["step_kinds"]))


def format_first_steps_table(rows) -> str:
    """Host ms by phase in a wave's first steps (bench/step_kinds.py), per
    row probed: where the first step's time goes beside a decode step's; ""
    where no row has first steps with phases."""
    firsts = {id(r): ((r.phases or {}).get("timed") or {}).get("step_kinds", {}).get("first")
              for r in rows}
    probed = [r for r in rows if (firsts[id(r)] or {}).get("phases")]
    names = [p for p in PHASE_ORDER if any(p in firsts[id(r)]["phases"] for r in probed)]
    return _decision_table(
        probed, "phases", "first steps, host ms by phase",
        f"{'ms':>7}" + "".join(f"{name:>{max(9, len(name) + 1)}}" for name in names),
        lambda row: f"{firsts[id(row)]['wall_ms']:>7.2f}" + "".join(
            f"{_ms(firsts[id(row)]['phases'].get(name)):>{max(9, len(name) + 1)}}"
            for name in names))


PHASE_ORDER = ("step", "forward", "verify", "compact_kv", "draft", "decode_step", "ingest",
               "draft_tree", "ingest_prefills", "ingest_decodes", "draft_apart",
               "adopt_prefixes", "save_prefixes", "grammar", "grammar_wait", "worker_rows",
               "root_masks", "grammar_choices")


def format_phases_table(rows) -> str:
    """Per decode step, for each row probed (bench/phases.py): wall ms, then
    per phase host ms (unprofiled run) / GPU ms / launches (profiled run)."""
    names = [p for p in PHASE_ORDER if any(p in _phase(r, "timed") or p in _phase(r, "profiled")
                                           for r in rows)]
    w = max([18] + [len(row.name) + 1 for row in rows])
    header = f"{'method':<{w}}{'batch':>6}{'steps':>7}{'wall ms':>9}" + "".join(
        f"{name + ' host/gpu ms (launches)':>34}" for name in names)
    by = sorted({r.phases["profiled"].get("gpu_ms_by", "?") for r in rows
                 if isinstance(r.phases.get("profiled"), dict)})
    lines = ["Where a decode step's time goes (per step; host ms without the profiler, "
             "GPU ms and launches under it; GPU ms by " + (", ".join(by) or "-") + ": "
             "launch = what the range's launches ran, span = its own span's kernels)",
             header, "-" * len(header)]
    for row in rows:
        if "error" in row.phases or not row.phases:
            lines.append(f"{row.name:<{w}}{row.batch_size:>6}  "
                         f"{row.phases.get('error', 'not probed')[:90]}")
            continue
        timed, profiled = row.phases["timed"], _phase(row, "profiled")
        cells = []
        for name in names:
            host = timed["phases"].get(name, {}).get("host_ms")
            gpu = profiled.get(name, {})
            cells.append(f"{_ms(host)}/{_ms(gpu.get('gpu_ms'))} "
                         f"({gpu.get('launches', float('nan')):.0f})")
        lines.append(f"{row.name:<{w}}{row.batch_size:>6}{timed['num_steps']:>7}"
                     f"{timed['wall_ms']:>9.2f}" + "".join(f"{c:>34}" for c in cells))
    return "\n".join(lines)


HOST_PROFILE_LINES = 12  # functions shown per row and ranking


def format_host_profiles(rows) -> str:
    """Per row with a host profile (bench/phases.py): the functions with the
    most own host time per step, then the most cumulative."""
    lines = ["Where the host time goes (cProfile in the worker, ms per step; it slows "
             "every call, so compare rows with each other)"]
    for row in rows:
        summary = (row.phases.get("host_profiled") or {}).get("host_profile")
        if not summary:
            continue
        lines.append(f"\n{row.name}, batch {row.batch_size}")
        for ranking in ("own", "cumulative"):
            lines.append(f"{'  by ' + ranking + ' time:':<72}{'own ms':>8}{'cum ms':>9}"
                         f"{'calls':>8}")
            lines += [f"    {f['function'][-68:]:<68}{f['own_ms']:>8.3f}{f['cum_ms']:>9.3f}"
                      f"{f['calls']:>8.1f}" for f in summary[ranking][:HOST_PROFILE_LINES]]
    return "\n".join(lines)


def _phase(row, key: str) -> dict:
    return (row.phases.get(key) or {}).get("phases", {})


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_online_table(rows) -> str:
    header = (f"{'server':<14}{'conc':>5}{'done':>6}{'fail':>5}{'req/s':>7}{'tok/s':>8}"
              f"{'x first':>8}{'TTFT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}"
              f"{'accept len':>11}{'exact':>8}  per-position acceptance")
    lines = [header, "-" * len(header)]
    for row in rows:
        length, per_pos = _acceptance_text(row.counts)
        speedup = "-" if math.isnan(row.speedup) else f"{row.speedup:.2f}"
        lines.append(
            f"{row.name:<14}{_load_text(row):>5}{row.num_completed:>6}{row.num_failed:>5}"
            f"{row.requests_per_second:>7.2f}{row.tokens_per_second:>8.1f}{speedup:>8}"
            f"{row.ttft_ms[50]:>8.1f}/{row.ttft_ms[99]:<8.1f}"
            f"{row.itl_ms[50]:>7.2f}/{row.itl_ms[99]:<8.2f}{length:>11}"
            f"{_exact_text(row.num_mismatches, row.num_first_only, 'ref'):>8}  {per_pos}")
    return "\n".join(lines)


def _load_text(row) -> str:
    """The concurrency of a steady load; a ramp's repeat (bench/ramp.py)."""
    return str(row.concurrency) if row.load == "steady" else f"r{row.repeat + 1}"


def format_ramp_summary(rows) -> str:
    """Per server over the ramp's repeats: tokens/s and its ratio to the
    first server's in the same repeat, median [range]."""
    names = list(dict.fromkeys(r.name for r in rows))
    header = f"{'server':<14}{'repeats':>8}{'tok/s median [range]':>28}{'x first median [range]':>26}"
    lines = [header, "-" * len(header)]
    for name in names:
        mine = [r for r in rows if r.name == name]
        speed = [r.tokens_per_second for r in mine]
        ratio = [r.speedup for r in mine if not math.isnan(r.speedup)]
        lines.append(f"{name:<14}{len(mine):>8}{spread(speed, '.1f'):>28}"
                     f"{spread(ratio, '.2f'):>26}")
    return "\n".join(lines)


def spread(values: list[float], fmt: str) -> str:
    """'median [min-max]' of `values` in `fmt`."""
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{statistics.median(ordered):{fmt}} [{ordered[0]:{fmt}}-{ordered[-1]:{fmt}}]"


def row_dict(row) -> dict:
    data = {k: v for k, v in asdict(row).items()
            if k not in ("token_ids", "texts", "counts", "top2_gaps")}
    data["counts"] = row.counts.as_dict()
    for key, value in list(data.items()):
        if isinstance(value, float) and math.isnan(value):
            data[key] = None
    return data


def write_results(out_dir: str | Path, stem: str, table: str, rows, settings: dict
                  ) -> dict[str, Path]:
    """`<stem>.txt` (the table), `<stem>.json` (settings + rows) and the plot."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"table": out / f"{stem}.txt", "json": out / f"{stem}.json",
             "plot": out / f"{stem}.png"}
    paths["table"].write_text(table + "\n")
    paths["json"].write_text(json.dumps(
        {"settings": settings, "rows": [row_dict(r) for r in rows]}, indent=2) + "\n")
    plot_rows(rows, paths["plot"], x_name=stem)
    return paths


def row_label(row) -> str:
    """The method's name, and its prompt set in a run of several."""
    prompt_set = getattr(row, "prompt_set", "")
    return f"{row.name} [{prompt_set}]" if prompt_set else row.name


def rows_by_set(rows) -> dict[str, list]:
    """{prompt set: its rows}, in the run's order ("": a run of one set)."""
    groups: dict[str, list] = {}
    for row in rows:
        groups.setdefault(getattr(row, "prompt_set", ""), []).append(row)
    return groups


def _by_name(rows) -> dict[str, list]:
    groups: dict[str, list] = {}
    for row in rows:
        if getattr(row, "error", None) is None:
            groups.setdefault(row_label(row), []).append(row)
    return groups


def _spread_bar(ax, x: int, values: list[float], colour) -> None:
    """A bar at the median of `values` with a line over their range."""
    if not values:
        ax.bar(x, math.nan, color=colour)
        return
    middle = statistics.median(values)
    ax.bar(x, middle, color=colour, yerr=[[middle - min(values)], [max(values) - middle]],
           capsize=4, ecolor="black")


def plot_rows(rows, path: Path, x_name: str) -> None:
    """Left: speed-up over the first method by batch size (offline) or
    concurrency (online), bars when there is one of them. Right: per-position
    acceptance over all runs of a method. One colour per method in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    online = x_name in ("online", "ramp")
    groups = _by_name(rows)
    palette = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    colours = {name: palette(i % palette.N) for i, name in enumerate(groups)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    xs_all = sorted({r.concurrency if online else r.batch_size for r in rows})
    for i, (name, group) in enumerate(groups.items()):
        xs = [r.concurrency if online else r.batch_size for r in group]
        speedups = [r.speedup for r in group]
        if len(xs_all) == 1:
            finite = [v for v in speedups if not math.isnan(v)]  # a ramp's repeats
            _spread_bar(left, i, finite, colours[name])
        else:
            left.plot(xs, speedups, marker="o", label=name, color=colours[name])
        counts = reduce(add, (r.counts for r in group), SpecDecodeCounts())
        rates = accepted_positions(counts)
        if rates:
            right.plot(range(1, len(rates) + 1), rates, marker="o", color=colours[name],
                       label=f"{name} (len {counts.mean_acceptance_length:.2f})")
    left.axhline(1.0, color="grey", linewidth=0.8)
    unit = "concurrent clients" if online else "batch size"
    if len(xs_all) == 1:
        left.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right",
                        fontsize=8)
        ramp = x_name == "ramp" and getattr(rows[0], "load", None)
        left.set_xlabel(f"{ramp}, median [range] of {len(rows) // len(groups)} passes" if ramp
                        else f"{unit} {xs_all[0]}")
    else:
        left.set(xlabel=unit)
        left.set_xscale("log", base=2)
        left.legend(fontsize=7)
    left.set(ylabel="tokens/s ÷ first (no speculation)", title="speed-up")
    right.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02),
              title="per-position acceptance")
    right.xaxis.get_major_locator().set_params(integer=True)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
