"""`vllm serve` under a bounded mixed load, with and without speculation.

    .venv/bin/python benchmarks/serve_load.py --requests 200 --concurrency 16 \
        --out docs/results/serve_load_tiny.json

Starts one server per method (no speculation, specplug_ngram, specplug_suffix,
specplug_hybrid) on loopback, sends each the same deterministic plan
(streaming and not, ~10% closed mid-stream, ~10% sampled with n=2,
max_tokens 1..48, chat and plain), one server at a time, and prints per server: requests sent,
completed, aborted, failed, requests/s, latency p50/p99, greedy outputs equal
to no speculation, KV cache usage and running requests after the load,
acceptance length.
"""
from __future__ import annotations

import argparse
import json
import tempfile

from vllm_specplug.bench.load import load_summary, make_plan, run_load, wait_until_idle
from vllm_specplug.bench.online import connect, read_counts
from vllm_specplug.bench.prompts import BenchPrompt
from vllm_specplug.models import build_model, held_out_prompts
from vllm_specplug.testing.server import serving

K = 4
SPECS = {
    "none": None,
    "specplug_ngram": {"method": "specplug_ngram", "num_speculative_tokens": K},
    "specplug_suffix": {"method": "specplug_suffix", "num_speculative_tokens": K},
    "specplug_hybrid": {"method": "specplug_hybrid", "num_speculative_tokens": K,
                        "proposers": [{"method": "specplug_suffix"},
                                      {"method": "specplug_ngram"}]},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", default=None, help="JSON of the summaries")
    args = parser.parse_args()
    texts = held_out_prompts(24)
    prompts = [BenchPrompt(text=t) for t in texts[:16]] + [
        BenchPrompt(messages=[{"role": "user", "content": f"Continue this code:\n{t}"}])
        for t in texts[16:]]
    plan = make_plan(prompts, args.requests, seed=0)
    rows, reference = {}, None
    with serving(build_model("tiny"), SPECS, tempfile.mkdtemp()) as urls:
        for name, url in urls.items():
            server = connect(name, url)
            before = read_counts(server)
            results, seconds = run_load(server, plan, args.concurrency)
            gauges = wait_until_idle(server)
            counts = read_counts(server) - before
            reference = reference or results
            differing = sum(q.greedy and r.status == ref.status == "completed"
                            and r.texts != ref.texts
                            for q, r, ref in zip(plan, results, reference))
            rows[name] = {**load_summary(results, seconds), "differing_from_none": differing,
                          "kv_cache_usage_after": gauges["vllm:kv_cache_usage_perc"],
                          "running_after": gauges["vllm:num_requests_running"],
                          "spec_decode": counts.as_dict()}
    print(f"{args.requests} requests, {args.concurrency} concurrent clients (greedy, "
          "except ~10% sampled with n=2); differ = greedy outputs unlike no speculation")
    print(f"{'server':<17}{'sent':>5}{'done':>5}{'abort':>6}{'fail':>5}{'req/s':>7}"
          f"{'p50 ms':>8}{'p99 ms':>8}{'differ':>7}{'KV after':>9}{'accept len':>11}")
    for name, row in rows.items():
        length = row["spec_decode"]["mean_acceptance_length"]
        print(f"{name:<17}{row['sent']:>5}{row['completed']:>5}{row['aborted']:>6}"
              f"{row['failed']:>5}{row['requests_per_second']:>7.2f}"
              f"{row['latency_ms']['p50']:>8.0f}{row['latency_ms']['p99']:>8.0f}"
              f"{row['differing_from_none']:>7}{row['kv_cache_usage_after']:>9.3f}"
              f"{'-' if length is None else f'{length:.2f}':>11}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"requests": args.requests, "concurrency": args.concurrency,
                       "servers": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
