"""`vllm-specplug demo`: the main job on a built-in model.

Generates from held-out prompts with no speculation, vLLM's built-in `ngram`,
`suffix` and `eagle3` (with the built-in EAGLE-3 head, trained by our own
extraction and training) and ours (n-gram, suffix decoding, hybrid) at the
same number of draft tokens, one engine at a time, and prints speed,
acceptance and exactness side by side; writes the table, JSON and a PNG.
"""
from __future__ import annotations

import os

from vllm_specplug.models.build import MODEL_SPECS, read_build_info

K = 5
NGRAM = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
DEMO_METHODS: dict[str, dict] = {
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": K, **NGRAM},
    "specplug_ngram": {"method": "specplug_ngram", "num_speculative_tokens": K, **NGRAM},
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": K},
    "specplug_suffix": {"method": "specplug_suffix", "num_speculative_tokens": K},
    "specplug_hybrid": {"method": "specplug_hybrid", "num_speculative_tokens": K,
                        "proposers": [{"method": "specplug_suffix", "min_token_prob": 0.2},
                                      {"method": "specplug_ngram", "prompt_lookup_max": 5}]},
}


def add_parser(sub) -> None:
    parser = sub.add_parser("demo", help="speculative vs plain generation on a "
                            "built-in model: vLLM's methods and ours side by side")
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SPECS))
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1,
                        help="generations per method; tok/s is the median. Suffix "
                        "decoding's global cache learns the prompts' answers on "
                        "the first, so later repeats flatter it")
    parser.add_argument("--out", default="specplug-demo",
                        help="directory for demo.txt, demo.json and demo.png")
    parser.set_defaults(func=run)


def run(args) -> int:
    # The table is the output; vLLM's per-engine start-up warnings (about this
    # machine, repeated for each of the engines) drown it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_specplug.bench.offline import side_by_side
    from vllm_specplug.bench.report import format_offline_table, write_results
    from vllm_specplug.models import build_model, held_out_prompts
    from vllm_specplug.models.heads import build_head

    model_dir = build_model(args.model)
    info = read_build_info(model_dir)
    print(f"model {args.model}: {info['num_params'] / 1e6:.1f}M parameters, "
          f"held-out loss {info['held_out_loss']:.3f} nats "
          f"(unigram {info['unigram_held_out_loss']:.3f}), at {model_dir}")
    prompts = held_out_prompts(args.num_prompts)
    methods = {"none": None, **DEMO_METHODS}
    if args.model == "tiny":
        methods["vllm-eagle3"] = {"method": "eagle3", "num_speculative_tokens": K,
                                  "model": str(build_head("tiny-eagle3"))}
    # Eager: on CPU, compiling each of the ~8 engines costs more than its generation.
    rows = side_by_side(model_dir, prompts, methods, args.max_tokens, args.repeats,
                        enforce_eager=True)
    table = format_offline_table(rows)
    print(f"\n{len(prompts)} held-out prompts, {args.max_tokens} new tokens each, "
          f"greedy, one batch, median of {args.repeats} run(s), K={K} draft tokens; exact = token for token equal "
          "to no speculation")
    print(table)
    paths = write_results(args.out, "demo", table, rows,
                          {"model": args.model, "num_prompts": len(prompts),
                           "max_tokens": args.max_tokens, "specs": methods})
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    ok = all(r.error is None and r.num_mismatches == 0 for r in rows)
    return 0 if ok else 1
