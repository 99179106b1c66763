"""`vllm-specplug bench`: speculative decoding measured side by side.

    vllm-specplug bench offline --model DIR --prompts FILE.jsonl \\
        --spec '{"method": "specplug_suffix", "num_speculative_tokens": 4}' \\
        --spec vllm-suffix='{"method": "suffix", "num_speculative_tokens": 4}' \\
        --batch-sizes 1 16 --repeats 3 --out results/
    vllm-specplug bench online --url none=http://127.0.0.1:8000 \\
        --url ours=http://127.0.0.1:8001 --prompts FILE.jsonl --concurrency 1 8 --out results/

Offline runs no speculation first, then each spec, one engine at a time.
Online measures servers already running, the first one as the reference.
Both print a table and write `<mode>.txt`, `<mode>.json` and `<mode>.png`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from vllm_specplug.cli.bench_inputs import (BUILTIN_PROMPT_SETS, PUBLIC_PROMPT_SETS,
                                            check_schemas, json_schema, load_prompt_sets,
                                            positive, prompt_limits)


def _common(parser) -> None:
    parser.add_argument("--prompts", action="append", default=None, help="a public set ("
                        + ", ".join(PUBLIC_PROMPT_SETS) + "; MT-Bench runs both turns); "
                        "JSONL, one request a line: {\"messages\": [...]} or "
                        "{\"turns\": [...]} (chat) or {\"prompt\": \"...\"} (plain); "
                        "or a set for the built-in model: " + ", ".join(BUILTIN_PROMPT_SETS)
                        + ". offline: repeat for several sets on the same engines, one "
                        "table each")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N lines")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (greedy) also checks outputs against the reference")
    parser.add_argument("--out", default=None, help="directory for table, JSON and PNG")


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="benchmark speculative configs offline or "
                            "servers online", description=__doc__,
                            formatter_class=_raw_formatter())
    modes = parser.add_subparsers(dest="mode", required=True)
    offline = modes.add_parser("offline", help="vllm.LLM engines, one per spec")
    offline.add_argument("--model", required=True,
                         help="local model directory, a built-in name ('tiny') or 'smollm2'")
    offline.add_argument("--spec", action="append", default=[], metavar="[NAME=]JSON|@FILE",
                         help="a speculative_config (repeat for several); ours or vLLM's")
    offline.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    offline.add_argument("--repeats", type=int, default=3,
                         help="report the median ratio to no speculation and its range")
    offline.add_argument("--warmup-runs", type=int, default=1,
                         help="unmeasured passes of each batch size when an engine has "
                         "started: shapes seen first compile kernels and capture graphs "
                         "there, not in a measured repeat (0: none)")
    offline.add_argument("--order", choices=("interleaved", "restart", "sequential"),
                         default="interleaved", help="interleaved: all engines start, "
                         "then each repeat runs every spec in turn (drift falls on every "
                         "row alike); restart: the same turns with one engine alive at a "
                         "time, started and stopped at each (less memory; quick with "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=0 on CPU); sequential: one "
                         "engine at a time, all its repeats in a row")
    offline.add_argument("--parallel-starts", action="store_true",
                         help="interleaved order: start (and warm up) every engine at once, "
                         "each in a thread, instead of one after the other; on a GPU each "
                         "gets a KV cache of half its memory share unless --engine-args sets "
                         "\"kv_cache_memory_bytes\" (vLLM would size it from the whole "
                         "device's free memory, which the other starts change)")
    offline.add_argument("--limit-prompts", action="append", default=[], metavar="BATCH=N",
                         help="at batch size BATCH run only the first N prompts "
                         "(e.g. 1=12: batch 1 over a whole set takes long); repeatable")
    offline.add_argument("--phases", action="store_true",
                         help="after the last repeat, one more pass per row with a probe "
                         "in the worker: host ms, GPU ms and launches per step for the "
                         "forward, verify and draft phases (a second table)")
    offline.add_argument("--host-profile", action="store_true",
                         help="with --phases, a third pass under cProfile in the worker: "
                         "the functions each row's host time per step goes to (a third "
                         "table; cProfile slows the host, compare rows with each other)")
    offline.add_argument("--json-schema", default=None, metavar="FILE",
                         help="every request's output under this JSON schema (vLLM's "
                         "structured outputs, its default backend): speculation under a "
                         "grammar")
    offline.add_argument("--max-model-len", type=int, default=2048)
    offline.add_argument("--dtype", default="auto", help="default: the model's own")
    offline.add_argument("--f32-dots", choices=("ieee", "tf32"), default=None,
                         help="the input precision of every Triton tl.dot on float32 "
                         "(TRITON_F32_DEFAULT, set before the engines start): vLLM's "
                         "Triton attention and ours. Triton's default on CUDA is TF32, "
                         "under which float32 is no token-for-token check (vLLM's own "
                         "eagle3 differed from no speculation on SmolLM2); 'ieee' makes "
                         "it one (docs/bench.md)")
    offline.add_argument("--engine-args", default="{}",
                         help="JSON of further vllm.LLM keyword arguments; vLLM's serving "
                         "defaults otherwise (graphs/compilation on: "
                         "'{\"enforce_eager\": true}' turns them off)")
    _common(offline)
    offline.set_defaults(func=run_offline_command)
    online = modes.add_parser("online", help="running OpenAI-compatible servers")
    online.add_argument("--url", action="append", required=True, metavar="[NAME=]URL",
                        help="a server, e.g. ours=http://127.0.0.1:8000 (repeat; the "
                        "first is the reference)")
    online.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    online.add_argument("--model-name", default=None,
                        help="served model name (default: the server's first)")
    online.add_argument("--timeout", type=float, default=600, help="seconds per request")
    online.add_argument("--ramp", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help="instead of --concurrency: a mixed load, concurrency doubling "
                        "from LOW to HIGH and halving back, servers interleaved per repeat")
    online.add_argument("--requests-per-client", type=int, default=2,
                        help="--ramp: requests per client at each stage")
    online.add_argument("--repeats", type=int, default=3, help="--ramp: passes of the ramp")
    online.add_argument("--warmup-passes", type=int, default=1,
                        help="--ramp: unmeasured passes per server first (kernels compiled "
                        "and graphs captured on first use; 0: none)")
    _common(online)
    online.set_defaults(func=run_online_command)
    ratios = modes.add_parser("ratios", help="per-repeat ratios between rows of an "
                              "offline or online result: median [range] of row over row")
    ratios.add_argument("json", help="offline.json of `bench offline --out DIR`, or "
                        "online.json / ramp.json of `bench online --out DIR`")
    ratios.add_argument("--over", action="append", required=True, metavar="NAME",
                        help="the reference row (repeat for several: the fastest of "
                        "them in each repeat)")
    ratios.add_argument("--row", action="append", default=None, metavar="NAME",
                        help="rows to report (default: every other row)")
    ratios.add_argument("--prompt-set", default=None, metavar="NAME",
                        help="a run of several --prompts sets: the rows of this one")
    ratios.add_argument("--decode", action="store_true",
                        help="compare each repeat's decode time (engine timestamps, first "
                        "token to last of its waves) instead of its tokens/s: steadier on a "
                        "host-bound GPU (offline results only)")
    ratios.set_defaults(func=run_ratios_command)


def _raw_formatter():
    import argparse

    return argparse.RawDescriptionHelpFormatter


def _fail(error: Exception) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 2


def _finish(rows, table: str, out: str | None, mode: str, settings: dict) -> int:
    from vllm_specplug.bench.report import write_results

    print(table)
    if out:
        paths = write_results(out, mode, table, rows, settings)
        (Path(out) / PARTIAL_FILE).unlink(missing_ok=True)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    # a request that first differs at a near-tie of the baseline is no failure
    # (bench/offline.py), nor online one where the baseline alone differs from
    # every other server, all agreeing (bench/online.py); any other difference is
    failed = [r for r in rows if getattr(r, "error", None) or getattr(r, "num_failed", 0)
              or (r.num_mismatches or 0) > _explained(r)]
    return 1 if failed else 0


def _engine_kwargs(text: str) -> dict:
    """--engine-args: a JSON object of vllm.LLM keywords, none that an
    option of its own sets."""
    engine_kwargs = json.loads(text)
    if not isinstance(engine_kwargs, dict):
        raise ValueError("--engine-args must be a JSON object")
    for key in ("dtype", "max_model_len"):
        if key in engine_kwargs:
            option = "--" + key.replace("_", "-")
            raise ValueError(f"--engine-args sets {key!r}, which {option} sets: "
                             f"pass {option} {engine_kwargs[key]} instead")
    return engine_kwargs


def run_offline_command(args) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm_specplug.bench.offline import run_offline
    from vllm_specplug.assets import AssetError
    from vllm_specplug.models.smollm2 import MissingDependencyError
    from vllm_specplug.bench.prompts import PromptFileError
    from vllm_specplug.bench.report import format_offline_table
    from vllm_specplug.bench.specs import SpecError, named_specs
    from vllm_specplug.bench.starts import check_parallel_starts
    from vllm_specplug.models.named import resolve_model

    try:
        positive(args, "batch_sizes", "repeats", "max_tokens")
        if args.warmup_runs < 0:
            raise ValueError("--warmup-runs must be >= 0 (0: no warm-up)")
        specs = named_specs(args.spec)
        limits = prompt_limits(args.limit_prompts)
        engine_kwargs = _engine_kwargs(args.engine_args)
        model = resolve_model(args.model)
        if model.startswith(("/", ".", "~")) and not os.path.isdir(model):
            raise ValueError(f"--model {model}: no such directory (a local model "
                             "directory, a hub id, or a built-in name such as 'tiny')")
        if args.parallel_starts:
            check_parallel_starts(args.order)
        if args.f32_dots is not None:  # before any engine (or its workers) starts
            os.environ["TRITON_F32_DEFAULT"] = args.f32_dots
        schema = json_schema(args.json_schema)
        prompt_sets = load_prompt_sets(args)
        check_schemas(schema, prompt_sets)
    except (SpecError, PromptFileError, AssetError, MissingDependencyError, ValueError,
            FileNotFoundError) as error:
        return _fail(error)
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0,
                            structured_outputs=StructuredOutputsParams(json=schema)
                            if schema is not None else None)
    _warn_replayed_cache(specs, args.repeats + args.warmup_runs)
    # one set keeps its rows unlabelled, as before sets could be several
    prompts = (prompt_sets if len(prompt_sets) > 1 else next(iter(prompt_sets.values())))
    rows = run_offline(model, prompts, specs, args.batch_sizes, args.repeats, params,
                       order=args.order, prompt_limits=limits, phases=args.phases,
                       host_profile=args.host_profile, warmup_runs=args.warmup_runs,
                       on_step=_partial_writer(args.out), max_model_len=args.max_model_len,
                       parallel_starts=args.parallel_starts, dtype=args.dtype, **engine_kwargs)
    all_prompts = [p for set_prompts in prompt_sets.values() for p in set_prompts]
    settings = {"model": model, "prompts": args.prompts[0] if len(args.prompts) == 1
                else args.prompts, "num_prompts": len(all_prompts),
                "num_turns": sum(p.num_turns for p in all_prompts),
                "max_tokens": args.max_tokens, "temperature": args.temperature,
                "repeats": args.repeats, "warmup_runs": args.warmup_runs,
                "order": args.order, "parallel_starts": args.parallel_starts,
                "prompt_limits": limits, "json_schema": schema, "dtype": args.dtype,
                # what float32 dots ran in (None: Triton's default, TF32 on CUDA)
                "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"),
                "specs": {s.name: s.config for s in specs}}
    # --limit-prompts: a batch size runs each set's first N prompts
    limited = "".join(f"; each set's first {n} at batch {b}" for b, n in sorted(limits.items()))
    print(f"\n{model}: {len(all_prompts)} prompts ({settings['num_turns']} turns{limited}), "
          f"{args.max_tokens} new tokens a turn, temperature {args.temperature}, "
          f"{args.repeats} repeat(s) {args.order}; tok/s = median, x none = median "
          "of per-repeat ratios [min-max]")
    rc = _finish(rows, _offline_tables(rows, args.phases, args.host_profile), args.out,
                 "offline", settings)
    _warn_low_precision(rows)
    return rc


def _warn_low_precision(rows) -> None:
    from vllm_specplug.bench.report import inexact_low_precision_rows

    names = inexact_low_precision_rows(rows)
    if names:
        print(f"note: {', '.join(names)} differ from no speculation on an engine below "
              "float32 (the dtype column). bf16/fp16 round differently under a verify "
              "step's batch shape, for every method, vLLM's own included; to check token "
              "for token pass --dtype float32 (on CUDA with --f32-dots ieee: Triton's "
              "float32 dots default to TF32 there) (docs/bench.md).", file=sys.stderr)


def _warn_replayed_cache(specs, num_passes: int) -> None:
    from vllm_specplug.bench.specs import replayed_suffix_cache_rows

    names = replayed_suffix_cache_rows(specs, num_passes)
    if names:
        print(f"note: a global suffix cache in {', '.join(names)}, and the prompts run "
              f"{num_passes} times (warm-up + repeats): later passes draft from the same "
              "prompts' earlier outputs, so their acceptance is higher than a server's on "
              "new questions. To measure without: \"max_cached_requests\": 0 (ours, also "
              "inside specplug_hybrid's proposers), \"suffix_decoding_max_cached_requests\": "
              "0 (vLLM's suffix).", file=sys.stderr)


PARTIAL_FILE = "offline.partial.json"


def _partial_writer(out: str | None):
    """Writes the rows measured so far to `out`/offline.partial.json after
    each step (a run killed at a time limit keeps its repeats); `_finish`
    removes it once the full results are written."""
    if not out:
        return None
    from vllm_specplug.bench.report import row_dict

    path = Path(out) / PARTIAL_FILE

    def write(rows) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": [row_dict(r) for r in rows]}) + "\n")
        tmp.replace(path)

    return write


def _offline_tables(rows, phases: bool, host_profile: bool) -> str:
    """The tables of each prompt set, one set after the other."""
    from vllm_specplug.bench.report import (format_first_steps_table, format_host_profiles,
                                            format_offline_table, format_phases_table,
                                            format_step_kinds_table, rows_by_set)

    sections = []
    for prompt_set, set_rows in rows_by_set(rows).items():
        tables = [format_offline_table(set_rows)]
        if phases or host_profile:
            tables += [t for t in (format_phases_table(set_rows),
                                   format_step_kinds_table(set_rows),
                                   format_first_steps_table(set_rows)) if t]
        if host_profile:
            tables.append(format_host_profiles(set_rows))
        title = [f"== prompts: {prompt_set} =="] if prompt_set else []
        sections.append("\n\n".join(title + tables))
    return "\n\n".join(sections)


def _servers(urls: list[str], model_name: str | None):
    from vllm_specplug.bench.online import connect

    servers, names = [], set()
    for i, argument in enumerate(urls):
        name, _, url = argument.rpartition("=") if "=" in argument else ("", "", argument)
        name = name or f"server{i + 1}"
        if name in names:
            raise ValueError(f"--url {argument!r}: the name {name!r} is used twice")
        names.add(name)
        servers.append(connect(name, url, model_name))
    return servers


def _explained(row) -> int:
    """A row's differences from the baseline that are not its own (above)."""
    return (getattr(row, "num_near_ties", None) or 0) + (getattr(row, "num_first_only", None)
                                                          or 0)


def run_ratios_command(args) -> int:
    from vllm_specplug.bench.ratios import load_rows, ratio_table, set_rows

    try:
        rows = set_rows(load_rows(args.json), args.prompt_set)
        print(ratio_table(rows, args.over, args.row, args.decode))
    except ValueError as error:
        return _fail(error)
    return 0


def run_online_command(args) -> int:
    from vllm_specplug.bench.online import ServerError, run_online
    from vllm_specplug.bench.prompts import PromptFileError
    from vllm_specplug.bench.report import format_online_table

    try:
        positive(args, "concurrency", "max_tokens")
        prompt_sets = load_prompt_sets(args)
        if len(prompt_sets) > 1:
            raise ValueError("bench online takes one --prompts set; run it once per set")
        prompts = next(iter(prompt_sets.values()))
        servers = _servers(args.url, args.model_name)
    except (ServerError, PromptFileError, ValueError) as error:
        return _fail(error)
    settings = {"servers": {s.name: s.url for s in servers}, "prompts": args.prompts[0],
                "num_prompts": len(prompts), "max_tokens": args.max_tokens,
                "temperature": args.temperature}
    if args.ramp:
        return _run_ramp(args, servers, prompts, settings)
    rows = run_online(servers, prompts, args.concurrency, args.max_tokens,
                      args.temperature, args.timeout)
    print(f"\n{len(prompts)} requests per level, {args.max_tokens} max new tokens, "
          f"temperature {args.temperature}; latency percentiles in ms")
    return _finish(rows, format_online_table(rows), args.out, "online", settings)


def _run_ramp(args, servers, prompts, settings: dict) -> int:
    from vllm_specplug.bench.ramp import (format_stage_tables, plot_stages, ramp_stages,
                                         run_ramps)
    from vllm_specplug.bench.report import format_online_table, format_ramp_summary

    try:
        positive(args, "requests_per_client", "repeats")
        stages = ramp_stages(*args.ramp)
    except ValueError as error:
        return _fail(error)
    if args.warmup_passes < 0:
        return _fail(ValueError(f"--warmup-passes must be >= 0, got {args.warmup_passes}"))
    rows = run_ramps(servers, prompts, stages, args.requests_per_client, args.repeats,
                     args.max_tokens, args.temperature, args.timeout, args.warmup_passes)
    settings.update(ramp=stages, requests_per_client=args.requests_per_client,
                    repeats=args.repeats, warmup_passes=args.warmup_passes)
    print(f"\nramp {stages}, {args.requests_per_client} requests per client a stage, "
          f"{args.max_tokens} max new tokens, temperature {args.temperature}; "
          "latency percentiles in ms")
    table = "\n\n".join([format_online_table(rows), format_ramp_summary(rows),
                         format_stage_tables(rows)])
    rc = _finish(rows, table, args.out, "ramp", settings)
    if args.out and rows and rows[0].stages:
        plot_stages(rows, Path(args.out) / "ramp_stages.png")
    return rc
