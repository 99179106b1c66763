"""Offline benchmark: the same prompts through several speculative configs,
side by side with no speculation, one `vllm.LLM` engine per config.

**Interleaved** (the default): every engine starts first, then each repeat
runs every config in turn, each repeat starting one config later, so drift
of the machine (clocks, other tenants) and a config's place in the turn fall
on every row alike; a row's ratio to no speculation is taken per repeat
(repeat r over the baseline's repeat r) and reported as median and range.
`order="restart"` interleaves the same way with one engine alive at a time:
each (repeat, config) step starts its engine and stops it after, for
machines where every config's engine does not fit at once (on CPU, each
costs about 2-3 GB in two processes; with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` an engine runs in this process and
starts in seconds). `order="sequential"` runs one engine at a time, all of
its repeats in a row.

**Warm-up**: with `warmup_runs`, each engine first runs every batch size's
prompts that many times, unmeasured, at the measured settings. Engines
compile kernels and capture graphs the first time a shape comes (vLLM's
Triton kernels and FlashAttention's splits; the EAGLE head of
vllm-specplug captures its passes lazily, per padded batch, key bucket and
tree shape): a first measured run then pays for them: on the H100 our rows'
first repeat at batch 16 and 64 ran at 0.45-0.7x of their later ones
(docs/results/v2_chain_ab_h100).

For each config and batch size the prompts run in consecutive batches of that
size; a conversation of several turns (MT-Bench) runs turn by turn, each turn
after the model's own answers. Under greedy sampling a row also counts the
requests whose tokens differ from the baseline's at the same batch size, and
how many of them first differ at a **near-tie** of the baseline (its top-2
log-probabilities there within `NEAR_TIE_GAP`, from one more unmeasured pass
of the baseline with `logprobs=2`): another batch shape may flip such a
token with or without speculation (fp32 on a GPU), anything else is a real
difference. A row of ours run beside vLLM's own speculation has a near-tie
excused only where vLLM's row differs at the same place too (issue 26's
rule, `bench/compare.py`).

Engines use vLLM's serving defaults (CUDA graphs or compilation, the model's
dtype) unless the caller passes other `vllm.LLM` arguments; what each engine
ran (arguments, runner, speculator) is kept on its rows.
"""
from __future__ import annotations

import logging
import statistics
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field

from tqdm import tqdm

from vllm_specplug.bench.compare import builtin_rows, compare_to_baseline, top2_gaps
from vllm_specplug.bench.prompts import (BenchPrompt, bench_prompt_of_input,
                                         sampling_params_for)
from vllm_specplug.bench.repeats import read_repeat_state, repeat_record
from vllm_specplug.bench.specs import NamedSpec
from vllm_specplug.bench.starts import (check_parallel_starts, start_all, start_engine,
                                        with_kv_cache_size)
from vllm_specplug.bench.worker_info import WORKER_INFO_QUALNAME
from vllm_specplug.bench.waves import WaveTimes
from vllm_specplug.engine import generate
from vllm_specplug.metrics import SpecDecodeCounts, vllm_collectors

logger = logging.getLogger("vllm_specplug.bench")
ORDERS = ("interleaved", "restart", "sequential")


@dataclass
class OfflineRow:
    name: str
    batch_size: int
    prompt_set: str = ""  # which of the run's prompt sets ("": the only one)
    tokens_per_second: list[float] = field(default_factory=list)  # one per repeat
    ratios: list[float] = field(default_factory=list)  # repeat r / baseline's repeat r
    counts: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    num_mismatches: int | None = None  # None: not compared (sampling, or failed)
    # of those, the ones whose first difference is a near-tie of the baseline
    num_near_ties: int | None = None   # None: the baseline's gaps are unknown
    # each differing request's first difference: {"request", "position",
    # "gap"}, the baseline's top-2 gap there (None: unknown), and for a row
    # of ours beside vLLM's own speculation "builtin_differs" (bench/compare.py)
    divergences: list[dict] = field(default_factory=list)
    speedup: float = float("nan")      # median of `ratios`
    error: str | None = None
    engine: dict = field(default_factory=dict)  # arguments, runner, speculator
    phases: dict = field(default_factory=dict)  # bench/phases.py, with --phases
    # the adaptive controller's counts over this row's repeats (None: off)
    adaptive: dict | None = None
    # the batch draft length's counts over this row's repeats (None: off;
    # integration/batch_schedule.py)
    batch_policy: dict | None = None
    # the head's graphs captured in service over this row's repeats, each a
    # stalled step (None: the method has no captured head passes)
    graph_captures: dict | None = None
    # each `generate` call's engine timestamps, summed over the repeats
    # (bench/waves.py; None: the engine kept no per-request stats)
    waves: dict | None = None
    # each timed repeat's step periods, summarised (bench/step_periods.py;
    # None where the engine has no worker extension of ours)
    step_periods: list[dict | None] = field(default_factory=list)
    # each measured repeat's own acceptance, prefix-cache hits and our
    # head's prefix hits adopted, missed and filled (bench/repeats.py)
    repeats: list[dict] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # baseline rows: per request, per token, log p(top-1) - log p(top-2)
    top2_gaps: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def median_tokens_per_second(self) -> float:
        return statistics.median(self.tokens_per_second) if self.tokens_per_second else 0.0

    @property
    def min_tokens_per_second(self) -> float:
        return min(self.tokens_per_second, default=0.0)


def serving_defaults(engine_kwargs: dict, num_engines: int = 1) -> dict:
    """`vllm.LLM` arguments with vLLM's serving defaults where `make_llm` pins
    test ones: CUDA graphs / compilation on, the model's own dtype. With
    several engines alive at once on one GPU each gets an equal share of its
    memory, unless the caller set `gpu_memory_utilization`.
    """
    options = {"enforce_eager": False, "dtype": "auto",
               "worker_extension_cls": WORKER_INFO_QUALNAME, **engine_kwargs}
    if num_engines > 1 and "gpu_memory_utilization" not in engine_kwargs:
        import torch

        if torch.cuda.is_available():
            options["gpu_memory_utilization"] = round(0.85 / num_engines, 3)
    return options


def run_conversations(llm, prompts: list[BenchPrompt], batch_size: int, params,
                      gaps: list[list[float]] | None = None, waves: WaveTimes | None = None
                      ) -> tuple[list[list[int]], float]:
    """Every prompt's tokens over all its turns, and the seconds spent generating
    (templating between turns is not timed). `gaps` (with `params.logprobs`
    >= 2): filled with each prompt's top-2 gaps, token by token; `waves`:
    each `generate` call's engine timestamps added."""
    tokenizer = llm.get_tokenizer()
    answers: list[list[str]] = [[] for _ in prompts]
    token_ids: list[list[int]] = [[] for _ in prompts]
    seconds = 0.0
    for turn in range(max(p.num_turns for p in prompts)):
        active = [i for i, p in enumerate(prompts) if p.num_turns > turn]
        inputs = [prompts[i].input_for(tokenizer, turn, answers[i]) for i in active]
        for start in range(0, len(active), batch_size):
            chunk = [prompts[i] for i in active[start:start + batch_size]]
            result = generate(llm, inputs[start:start + batch_size],
                              sampling_params_for(chunk, params))
            seconds += result.seconds
            if waves is not None:
                waves.add(result.outputs)
            for i, ids, text in zip(active[start:start + batch_size], result.token_ids,
                                    result.texts):
                token_ids[i] += ids
                answers[i].append(text)
            if gaps is not None:
                for i, per_token in zip(active[start:start + batch_size],
                                        top2_gaps(result.outputs)):
                    gaps[i] += per_token
    return token_ids, seconds


def _measure(llm, row: OfflineRow, prompts, params, keep_tokens: bool,
             collectors: list | None = None) -> None:
    """One repeat of `row`; `collectors`: the engine's own metrics (several
    engines run interleaved in this process, and the newest holds the
    registry: without them an older engine's repeats would go uncounted)."""
    before = read_repeat_state(llm, collectors, _worker_call(llm, "specplug_head_counters"))
    adaptive_before = _adaptive_stats(llm)
    policy_before = _worker_call(llm, "specplug_batch_policy")
    captures_before = _worker_call(llm, "specplug_graph_captures")
    waves = WaveTimes()
    _worker_call(llm, "specplug_step_periods_start")
    token_ids, seconds = run_conversations(llm, prompts, row.batch_size, params, waves=waves)
    row.step_periods.append(_worker_call(llm, "specplug_step_periods_take"))
    row.waves = waves.merged(row.waves)
    row.graph_captures = captures_delta(row.graph_captures, captures_before,
                                        _worker_call(llm, "specplug_graph_captures"))
    after = read_repeat_state(llm, collectors, _worker_call(llm, "specplug_head_counters"))
    row.counts = row.counts + (after.counts - before.counts)
    row.repeats.append(repeat_record(before, after,
                                     waves.decode_ms if waves.num_waves else None))
    row.adaptive = adaptive_delta(row.adaptive, adaptive_before, _adaptive_stats(llm))
    row.batch_policy = batch_policy_delta(row.batch_policy, policy_before,
                                          _worker_call(llm, "specplug_batch_policy"))
    row.tokens_per_second.append(sum(len(t) for t in token_ids) / seconds)
    if keep_tokens:
        row.token_ids = token_ids


def _adaptive_stats(llm) -> dict | None:
    return _worker_call(llm, "specplug_adaptive_stats")


def _worker_call(llm, method: str):
    """The first worker's answer to our worker extension's `method`."""
    try:
        return llm.collective_rpc(method)[0]
    except Exception:  # noqa: BLE001 - a user's worker extension has no such call
        return None


def captures_delta(total: dict | None, before: dict | None, after: dict | None
                   ) -> dict | None:
    """`total` plus the captures between `before` and `after`
    (`PassGraphs.service_captures`), and the graphs held as of `after`."""
    if after is None or before is None:
        return total
    total = dict(total or {"num_captures": 0, "capture_seconds": 0.0, "kernel_compiles": {}})
    for key in ("num_captures", "capture_seconds"):
        total[key] += after[key] - before[key]
    total["num_graphs"] = after["num_graphs"]
    if "draft_compile" in after:  # as of `after`: each step's compiled calls (None: eager)
        total["draft_compile"] = after["draft_compile"]
    compiles = Counter(total["kernel_compiles"])
    compiles.update(Counter(after.get("kernel_compiles", {})) - Counter(
        before.get("kernel_compiles", {})))
    total["kernel_compiles"] = dict(compiles)
    return total


def batch_policy_delta(total: dict | None, before: dict | None, after: dict | None
                       ) -> dict | None:
    """`total` plus the batch policy's counts between `before` and `after`
    (`BatchDraftLength.counters`); its state (`SNAPSHOT_KEYS`: the length it
    runs, expected tokens per length, step times) as of `after`."""
    from vllm_specplug.adaptive.batch_draft_stats import SNAPSHOT_KEYS

    if after is None:
        return total
    before = before or {}
    total = total or {}
    out = {key: after[key] for key in SNAPSHOT_KEYS if key in after}
    for key, value in after.items():
        if key in SNAPSHOT_KEYS:
            continue
        if isinstance(value, dict):  # per length: chosen, priced_*, expected_seconds
            out[key] = {k: n - before.get(key, {}).get(k, 0) + total.get(key, {}).get(k, 0)
                        for k, n in value.items()}
        else:
            out[key] = value - before.get(key, 0) + total.get(key, 0)
    return out


def adaptive_delta(total: dict | None, before: dict | None, after: dict | None
                   ) -> dict | None:
    """`total` plus the controller's counts between `before` and `after`;
    its cost coefficients and acceptance rates as of `after`."""
    if before is None or after is None:
        return total
    out = dict(after)
    for key, value in after.items():
        if key.startswith("num_") or key == "expected_accepted":
            out[key] = value - before[key] + (total or {}).get(key, 0)
    out["mean_kept_per_request"] = out["num_kept"] / max(out["num_requests"], 1)
    return out


def _record_top2_gaps(llm, row: OfflineRow, prompts, params) -> None:
    """One more pass of the baseline's batch with `logprobs=2`: its top-2 gap
    at every token. A request whose tokens in this pass differ from the
    measured ones keeps no gaps (an unknown gap never counts as a tie)."""
    gaps: list[list[float]] = [[] for _ in prompts]
    with_logprobs = params.clone()
    with_logprobs.logprobs = 2
    token_ids, _ = run_conversations(llm, prompts, row.batch_size, with_logprobs, gaps)
    row.top2_gaps = [g if ids == measured else []
                     for g, ids, measured in zip(gaps, token_ids, row.token_ids)]


def _probe_phases(llm, row: OfflineRow, prompts, params, host_profile: bool = False) -> None:
    """More passes over one batch with the phase probe (bench/phases.py)."""
    from vllm_specplug.bench.phases import probe

    prompts = prompts[:max(row.batch_size, 4)]
    try:
        row.phases = probe(llm, lambda: run_conversations(llm, prompts, row.batch_size,
                                                          params), host_profile)
    except Exception as error:  # the probe informs; the measured rows stand
        row.phases = {"error": f"{type(error).__name__}: {error}"}


def _schedule(specs: list[NamedSpec], repeats: int, order: str) -> list[tuple[int, int]]:
    """(repeat, spec index) in the order they run. Interleaved, each repeat
    starts one spec later than the one before (a Latin square): a spec's
    place in the turn, right after a heavy row or first after another
    spec's, does not favour it in every repeat."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: choose one of {ORDERS}")
    n = len(specs)
    if order in ("interleaved", "restart"):
        return [(r, (r + s) % n) for r in range(repeats) for s in range(n)]
    return [(r, s) for s in range(n) for r in range(repeats)]


def _warm_up(llm, rows: list[OfflineRow], prompt_sets: dict[str, list[BenchPrompt]],
             limits: dict[int, int], params, runs: int) -> None:
    """`runs` unmeasured passes of each row's batch: the shapes a measured
    repeat meets compile and capture here (counts are read around each
    measured repeat, so these never reach a row)."""
    for row in rows:
        for _ in range(runs):
            run_conversations(llm, _row_prompts(row, prompt_sets, limits), row.batch_size,
                              params)


def _row_prompts(row: OfflineRow, prompt_sets: dict[str, list[BenchPrompt]],
                 limits: dict[int, int]) -> list[BenchPrompt]:
    return prompt_sets[row.prompt_set][:limits.get(row.batch_size)]


def _as_sets(prompts) -> dict[str, list[BenchPrompt]]:
    """{set name: prompts}; a plain list is one unnamed set."""
    if isinstance(prompts, dict):
        if not prompts:
            raise ValueError("no prompt sets given")
        return prompts
    return {"": list(prompts)}


def run_offline(model: str, prompts, specs: list[NamedSpec],
                batch_sizes: list[int], repeats: int, params, order: str = "interleaved",
                prompt_limits: dict[int, int] | None = None, phases: bool = False,
                host_profile: bool = False, warmup_runs: int = 0,
                on_step=None, parallel_starts: bool = False,
                **engine_kwargs) -> list[OfflineRow]:
    """One row per (spec, prompt set, batch size). `prompts`: a list of
    `BenchPrompt`s, or {set name: list} to run several sets on the same
    engines (an engine's start costs more than its generations on a GPU).
    The first spec is the baseline; a spec whose engine fails gets rows with
    `error` set and the others go on. `prompt_limits` {batch size: N} runs
    only the first N prompts of a set at that batch size (batch 1 of a whole
    set takes long). With `phases`, each row also gets where its steps' time
    went, after its last repeat; with `host_profile` too, the functions its
    host time went to. `warmup_runs`: unmeasured passes of every row when an
    engine has started. `on_step(rows)`, if given, sees every row after each
    (repeat, spec) step: a run cut short keeps what it measured.
    `parallel_starts`: every engine started (and warmed up) at once, each
    in a thread (bench/starts.py; interleaved order only)."""
    if parallel_starts:
        check_parallel_starts(order)
    limits = prompt_limits or {}
    prompt_sets = _as_sets(prompts)
    schedule = _schedule(specs, repeats, order)
    engine_kwargs = serving_defaults(engine_kwargs, num_engines=len(specs)
                                     if order == "interleaved" else 1)
    engine_kwargs.setdefault("max_num_seqs", max(batch_sizes))
    if parallel_starts:
        engine_kwargs = with_kv_cache_size(engine_kwargs)
    rows = [[OfflineRow(s.name, b, set_name) for set_name in prompt_sets for b in batch_sizes]
            for s in specs]
    builtin = builtin_rows(specs)
    # restart: each (repeat, spec) step starts its engine and stops it after
    last_use = {s: i for i, (_, s) in enumerate(schedule)} if order != "restart" else None
    engines: dict[int, object] = {}
    collectors: dict[int, list] = {}  # each engine's own Prometheus collectors
    with ExitStack() as all_engines, tqdm(total=len(schedule) * len(rows[0]),
                                          desc="bench", unit="run") as progress:
        stacks = {s: all_engines.enter_context(ExitStack()) for s in range(len(specs))}
        first_prompts = next(iter(prompt_sets.values()))

        def warm_up(llm, s: int) -> None:
            _warm_up(llm, rows[s], prompt_sets, limits, params, warmup_runs)

        if parallel_starts:
            progress.set_postfix_str(f"{len(specs)} engines starting at once")
            started = start_all(stacks, model, specs, engine_kwargs, first_prompts, rows,
                                warm_up)
            for s, (llm, found) in started.items():
                engines[s], collectors[s] = llm, found
        for step, (repeat, s) in enumerate(schedule):
            progress.set_postfix_str(f"{specs[s].name} repeat {repeat + 1}")
            if s not in engines:  # not started yet, or failed among the others
                engines[s] = start_engine(stacks[s], model, specs[s], engine_kwargs,
                                          first_prompts, rows[s])
                collectors[s] = vllm_collectors()
                if engines[s] is not None and warmup_runs:
                    progress.set_postfix_str(f"{specs[s].name} warm-up")
                    warm_up(engines[s], s)
            for row in rows[s]:
                if engines[s] is not None:
                    _run_row(engines[s], row, prompt_sets, limits, params, collectors[s],
                             first=repeat == 0, baseline=s == 0,
                             probe=(phases or host_profile) and repeat == repeats - 1,
                             host_profile=host_profile)
                progress.update(1)
            if last_use is None and engines[s] is not None:  # a failed one stays failed
                stacks[s].close()
                del engines[s]
            elif last_use is not None and last_use[s] == step:
                stacks[s].close()  # sequential order: free the engine now
            if on_step is not None:  # the rows so far, compared as far as they ran
                flat = [row for spec_rows in rows for row in spec_rows]
                compare_to_baseline(flat, specs[0].name, params.temperature == 0, builtin)
                on_step(flat)
    flat = [row for spec_rows in rows for row in spec_rows]
    compare_to_baseline(flat, specs[0].name, params.temperature == 0, builtin)
    return flat


def _run_row(llm, row: OfflineRow, prompt_sets, limits, params, collectors, first: bool,
             baseline: bool, probe: bool, host_profile: bool) -> None:
    """One measured repeat of `row`; the baseline's first also records its
    top-2 gaps, and a last repeat with `probe` runs the phase probe."""
    prompts = _row_prompts(row, prompt_sets, limits)
    _measure(llm, row, prompts, params, keep_tokens=first, collectors=collectors)
    if first and baseline and params.temperature == 0:
        _record_top2_gaps(llm, row, prompts, params)
    if probe:
        _probe_phases(llm, row, prompt_sets[row.prompt_set], params, host_profile)


def side_by_side(model: str, inputs: list, methods: dict[str, dict | None],
                 max_tokens: int, repeats: int = 1, order: str = "interleaved",
                 **engine_kwargs) -> list[OfflineRow]:
    """All `inputs` (texts, token-id prompts or `BenchPrompt`s) as one greedy
    batch through each method, `repeats` times in `order` (ORDERS); the first
    method must be the baseline (config None)."""
    from vllm import SamplingParams

    names = list(methods)
    if methods[names[0]] is not None:
        raise ValueError("the first method must be the baseline (config None)")
    specs = [NamedSpec(name, methods[name]) for name in names]
    prompts = [p if isinstance(p, BenchPrompt) else bench_prompt_of_input(p) for p in inputs]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return run_offline(str(model), prompts, specs, [len(prompts)], repeats, params,
                       order=order, **engine_kwargs)
