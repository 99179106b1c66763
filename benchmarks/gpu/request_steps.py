"""Each request's verify steps and acceptance, vLLM's `eagle3` beside ours
(a diagnostic for issue 26: at batch 64 on the H100 our chain's waves took
125 steps for 128 tokens where vLLM's K=5 took 110, for the same mean
acceptance, docs/results/smollm2_chains_b64_h100_s72: one request of ours
accepted almost nothing, or one started late: the wave's engine
timestamps tell which).

vLLM's own per-request metrics (`per_request_spec_decode_metrics`
"detailed") give each finished request's accepted count per verify step.
One engine per row, one after the other, on the same prompts (MT-Bench's
first turns, or both: each row's second turn after the first row's
answers), greedy.

    python3 benchmarks/gpu/request_steps.py --head DIR --model DIR
        [--batch-size 64] [--max-tokens 128] [--turns 2] [--cpu]
        [--rows vllm-eagle3-K5,ours-chain-K5[,ours-tree16][,none][,...-nopfx]]

JSON to $OUT/request_steps.json; on stdout each row's wave (its length,
its last request's schedule), the requests with the most verify steps and
when each was scheduled and decoded, and where the rows' outputs part.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def row_specs(head: str) -> dict[str, dict | None]:
    """The sync probe's rows (vLLM's `eagle3` K=5, our chain K=5 and tree
    16) and `none` (no speculation), each also as `NAME-nopfx`: the same
    with prefix caching off."""
    from sync_probe import row_specs as probe_rows  # benchmarks/gpu/, beside this script

    specs = {"none": None, **probe_rows(head)}
    return {**specs, **{f"{name}-nopfx": spec for name, spec in specs.items()}}


def run_row(model_dir, name: str, spec: dict, prompts, args) -> list[dict]:
    from vllm_specplug.engine import make_llm, shutdown_llm

    # on CPU our test defaults (eager, float32); on the GPU as `bench offline`
    device_args = {} if args.cpu else dict(enforce_eager=False, dtype="bfloat16",
                                           gpu_memory_utilization=0.3)
    metrics = {} if spec is None else {"per_request_spec_decode_metrics": "detailed"}
    llm = make_llm(model_dir, spec, max_num_seqs=args.batch_size, max_model_len=2048,
                   **metrics,
                   enable_prefix_caching=not name.endswith("-nopfx"), **device_args)
    try:
        return [turn_records(llm, prompts, turn, args) for turn in range(args.turns)]
    finally:
        shutdown_llm(llm)


def turn_records(llm, prompts, turn: int, args) -> list[dict]:
    """One turn of every conversation (after the answers kept in
    `args.answers`), twice: the first warms captures and the prefix cache,
    the second is recorded."""
    from vllm_specplug.engine import greedy_params

    tokenizer = llm.get_tokenizer()
    answers = args.answers.setdefault(turn, None)
    inputs = [p.input_for(tokenizer, turn, answers_before(args.answers, turn, i))
              for i, p in enumerate(prompts)]
    params = greedy_params(args.max_tokens)
    llm.generate(inputs, params, use_tqdm=False)
    outputs = llm.generate(inputs, params, use_tqdm=False)
    if answers is None:  # the first row's answers make every row's next turn
        args.answers[turn] = [o.outputs[0].text for o in outputs]
    return [request_record(o) for o in outputs]


def answers_before(answers: dict, turn: int, i: int) -> list[str]:
    return [answers[t][i] for t in range(turn)]


def request_record(output) -> dict:
    completion = output.outputs[0]
    metrics = getattr(completion, "spec_decode_metrics", None) or output.spec_decode_metrics
    record = {"num_tokens": len(completion.token_ids), "token_ids": list(completion.token_ids),
              "num_prompt_tokens": len(output.prompt_token_ids or []),
              "num_cached_tokens": output.num_cached_tokens}
    stats = getattr(output, "metrics", None)  # engine-core timestamps (monotonic, s)
    if stats is not None:
        record.update({key: getattr(stats, key) for key in
                       ("scheduled_ts", "first_token_ts", "last_token_ts")})
    if metrics is not None:
        record.update(metrics.to_dict())
    return record


def moments(record: dict, records: list[dict]) -> str:
    """A request's schedule, first and last token, ms after the wave's first
    schedule ("-" without the engine's timestamps)."""
    if not record.get("scheduled_ts"):
        return "-"
    start = min(r["scheduled_ts"] for r in records)
    return "/".join(f"{1e3 * (record[key] - start):.0f}"
                    for key in ("scheduled_ts", "first_token_ts", "last_token_ts"))


def timeline(records: list[dict]) -> str:
    """The wave's length and its last request's schedule, so a request
    started late is told from one that decoded slowly."""
    if not all(r.get("scheduled_ts") for r in records):
        return "no engine timestamps"
    start = min(r["scheduled_ts"] for r in records)
    return (f"wave {1e3 * (max(r['last_token_ts'] for r in records) - start):.0f} ms, "
            f"last scheduled at {1e3 * (max(r['scheduled_ts'] for r in records) - start):.0f} ms")


def report(rows: dict[str, list[dict]], top: int) -> None:
    """`rows`: {row name: [request record]} of one turn."""
    from vllm_specplug.bench.compare import first_divergence

    names = list(rows)
    for name in names:
        records = rows[name]
        order = sorted(range(len(records)), key=lambda i: -records[i].get("num_spec_steps", 0))
        first = sum(sum(r.get("acceptance_histogram", [])[1:]) for r in records)
        print(f"{name}: longest request {max(r.get('num_spec_steps', 0) for r in records)} "
              f"verify steps, first drafts accepted {first}; {timeline(records)}; most "
              "verify steps (request: steps, tokens, mean accept len, ms from the "
              "wave's first schedule to its own schedule / first token / last token)")
        for i in order[:top]:
            r = records[i]
            print(f"  {i:3d}: {r.get('num_spec_steps')} steps, {r['num_tokens']} tokens, "
                  f"{r.get('mean_acceptance_length', 0):.3f}, {moments(r, records)} ms, "
                  f"prompt {r['num_prompt_tokens']} ({r['num_cached_tokens']} cached); per step "
                  f"{''.join(str(a) for a in r.get('per_step_accepted', [])[:80])}")
    report_parted(rows)
    for name in names[1:]:  # each row beside the first
        print(f"{name} beside {names[0]}: requests whose outputs part or steps differ by > 5")
        for i, (x, y) in enumerate(zip(rows[names[0]], rows[name])):
            steps = (x.get("num_spec_steps") or 0, y.get("num_spec_steps") or 0)
            diff = first_divergence(x["token_ids"], y["token_ids"])
            if diff is not None or abs(steps[0] - steps[1]) > 5:
                print(f"  request {i}: steps {steps}, outputs part at {diff}")


def report_parted(rows: dict[str, list[dict]]) -> None:
    """Which requests' outputs part from no speculation's (a `none` row):
    in bf16 a row that parts may escape, or fall into, a continuation its
    head cannot draft, and its wave's length with it."""
    from vllm_specplug.bench.compare import first_divergence

    baseline = next((n for n in rows if n.split("-nopfx")[0] == "none"), None)
    for name in rows:
        if baseline is not None and name != baseline:
            parted = [i for i, (x, y) in enumerate(zip(rows[baseline], rows[name]))
                      if first_divergence(x["token_ids"], y["token_ids"]) is not None]
            print(f"{name}: {len(parted)} outputs part from {baseline}'s: {parted}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rows", default="vllm-eagle3-K5,ours-chain-K5")
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--cpu", action="store_true", help="eager float32 (the V1 runner)")
    parser.add_argument("--turns", type=int, default=1, help="MT-Bench turns (1 or 2)")
    args = parser.parse_args()
    from vllm_specplug.bench.sets import load_public_set

    model_dir = args.model
    prompts = load_public_set("mt-bench", args.batch_size)
    specs = row_specs(args.head)
    args.answers = {}
    out = Path(os.environ.get("OUT", ".")) / "request_steps.json"
    rows = {}
    for name in args.rows.split(","):  # each row reported and kept as it ends
        rows[name] = run_row(model_dir, name, specs[name], prompts, args)
        out.write_text(json.dumps(rows))
        for turn in range(args.turns):
            print(f"== turn {turn + 1}", flush=True)
            report({n: turns[turn] for n, turns in rows.items()}, args.top)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
