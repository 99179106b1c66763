"""`vllm-specplug demo`: the main job on a built-in model.

Generates from held-out prompts with no speculation and with vLLM's built-in
`ngram` and `suffix` methods, and prints speed and acceptance side by side.
"""
from __future__ import annotations

import os

from vllm_specplug.models import build_model, held_out_prompts
from vllm_specplug.models.build import MODEL_SPECS, read_build_info

BUILTIN_METHODS: dict[str, dict | None] = {
    "none": None,
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 4,
                   "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def add_parser(sub) -> None:
    parser = sub.add_parser("demo", help="speculative vs plain generation on a "
                            "built-in model")
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SPECS))
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.set_defaults(func=run)


def run(args) -> int:
    # The table is the output; vLLM's per-engine start-up logs drown it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm_specplug.testing.sidebyside import format_table, run_side_by_side

    model_dir = build_model(args.model)
    info = read_build_info(model_dir)
    print(f"model {args.model}: {info['num_params'] / 1e6:.1f}M parameters, "
          f"held-out loss {info['held_out_loss']:.3f} nats "
          f"(unigram {info['unigram_held_out_loss']:.3f}), at {model_dir}")
    prompts = held_out_prompts(args.num_prompts)
    rows = run_side_by_side(model_dir, prompts, BUILTIN_METHODS, args.max_tokens)
    print(f"\n{len(prompts)} held-out prompts, {args.max_tokens} new tokens each, "
          "greedy, one batch:")
    print(format_table(rows))
    return 0 if all(r.num_mismatches == 0 for r in rows) else 1
