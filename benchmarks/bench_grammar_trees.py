"""Draft trees under a JSON schema (issue 30), CPU: the built-in tiny model and
its EAGLE-3 head on held-out prompts, or SmolLM2-135M-Instruct and its
`smollm2-eagle3-demo` head on MT-Bench questions answered as JSON; exactness
against no speculation with the same schema, and acceptance with and
without the schema, per method:

    .venv/bin/python benchmarks/bench_grammar_trees.py --out docs/results/grammar_trees_cpu
    .venv/bin/python benchmarks/bench_grammar_trees.py --target smollm2 --prompts 16 \
        --out docs/results/grammar_trees_cpu/smollm2

`tokens/step` is output tokens over engine steps (every step emits one token
plus its accepted drafts): vLLM's acceptance length (`accept len`) counts
only steps that had drafts, and under a grammar many chain steps have none
(their drafts are cut at the first invalid token), which inflates it.
Greedy acceptance does not vary between runs, so one run is reported; no
speed is claimed here (the CPU engine at this batch is below no speculation
for every method, as the issue found).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

SCHEMA = {"type": "object", "required": ["name", "age", "tags", "ok"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
    "ok": {"type": "boolean"}}}
VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"


def methods(head: str) -> dict[str, tuple[dict | None, dict]]:
    """name: (speculative config, engine arguments)."""
    tree = {"method": "specplug_eagle3", "model": head, "topk": 4, "num_steps": 4,
            "num_draft_tokens": 16}
    chain = {"method": "specplug_eagle3", "model": head, "topk": 1, "num_steps": 5}
    return {
        "none": (None, {}),
        "ours-tree16": (tree, {}),
        # the drafter ranks every token; the scheduler prunes what the grammar forbids
        "ours-tree16-unmasked": ({**tree, "grammar_drafts": False}, {}),
        "ours-tree16-deep": ({**tree, "topk": 2, "num_steps": 8}, {}),
        # a scheduler that reads drafts as chains: structured-output requests
        # then draft the tree's chain prefix (the lossless fallback)
        "ours-tree16-chain-prefix": (tree, {"scheduler_cls": VLLM_SCHEDULER}),
        "ours-chain-K5": (chain, {}),
        "ours-chain-K5-unmasked": ({**chain, "grammar_drafts": False}, {}),
        "vllm-eagle3-K5": ({"method": "eagle3", "model": head,
                            "num_speculative_tokens": 5}, {}),
    }


def run_method(model, spec, engine_args, prompts, params: dict, baseline: dict) -> dict:
    from vllm_specplug.metrics import read_spec_decode_counts
    from vllm_specplug.testing.engine import generate, make_llm, shutdown_llm

    llm, row = make_llm(model, spec, **engine_args), {}
    try:
        for label, sampling in params.items():
            before = read_spec_decode_counts(llm) if spec else None
            out = generate(llm, prompts, sampling)
            if spec is None:
                baseline[label] = out.token_ids
                continue
            counts = read_spec_decode_counts(llm) - before
            steps = out.num_output_tokens - counts.num_accepted_tokens
            row[label] = {
                "exact": sum(a == b for a, b in zip(out.token_ids, baseline[label])),
                "tokens_per_step": out.num_output_tokens / steps,
                "accept_len": counts.mean_acceptance_length if counts.num_drafts else None,
                "drafts": counts.num_drafts, "draft_tokens": counts.num_draft_tokens,
                "per_position": [round(p, 3) for p in counts.per_position_acceptance]}
    finally:
        shutdown_llm(llm)
    return row


def table(rows: dict, num_prompts: int) -> str:
    lines = [f"{'method':26} {'constraint':10} {'exact':>7} {'tokens/step':>12} "
             f"{'accept len':>11} {'drafts':>7} {'draft tokens':>13}"]
    for name, row in rows.items():
        for label, r in row.items():
            accept = "-" if r["accept_len"] is None else f"{r['accept_len']:.2f}"
            lines.append(f"{name:26} {label:10} {r['exact']:>3}/{num_prompts:<3} "
                         f"{r['tokens_per_step']:>12.2f} {accept:>11} {r['drafts']:>7} "
                         f"{r['draft_tokens']:>13}")
    return "\n".join(lines)


def tiny_workload(num_prompts: int) -> tuple[str, str, list[str], dict]:
    """The tiny model, its head, held-out prompts and SCHEMA."""
    from vllm_specplug.models import build_model, held_out_prompts
    from vllm_specplug.models.heads import build_head

    return (str(build_model("tiny")), str(build_head("tiny-eagle3")),
            held_out_prompts(num_prompts), SCHEMA)


def smollm2_workload(num_prompts: int) -> tuple[str, str, list[str], dict]:
    """SmolLM2-135M-Instruct (fp32), its EAGLE-3 head `smollm2-eagle3-demo`,
    MT-Bench's first turns as chats asking for MT_BENCH_JSON_SCHEMA's object
    (the `mt-bench-json` set of `bench offline`)."""
    from transformers import AutoTokenizer

    from vllm_specplug.models.heads import build_head
    from vllm_specplug.models.smollm2 import build_smollm2
    from vllm_specplug.public_sets import MT_BENCH_JSON_SCHEMA, mt_bench_json

    model = str(build_smollm2("float32"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": turns[0]}], tokenize=False,
        add_generation_prompt=True) for turns in mt_bench_json(num_prompts)]
    return model, str(build_head("smollm2-eagle3-demo")), prompts, MT_BENCH_JSON_SCHEMA


def main() -> None:
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_specplug.engine import greedy_params

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", choices=("tiny", "smollm2"), default="tiny",
                        help="smollm2: MT-Bench questions answered as JSON objects")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=None,
                        help="a subset of the methods (no speculation always runs)")
    args = parser.parse_args()
    workload = tiny_workload if args.target == "tiny" else smollm2_workload
    model, head, prompts, schema = workload(args.prompts)
    params = {"schema": greedy_params(args.max_tokens, structured_outputs=
                                      StructuredOutputsParams(json=schema)),
              "none": greedy_params(args.max_tokens)}
    baseline: dict = {}
    rows = {name: run_method(model, spec, engine_args, prompts, params, baseline)
            for name, (spec, engine_args) in tqdm(methods(head).items(), desc="engines")
            if name == "none" or args.methods is None or name in args.methods}
    rows.pop("none")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_trees.json").write_text(json.dumps(
        {"target": args.target, "schema": schema, "prompts": len(prompts),
         "max_tokens": args.max_tokens, "rows": rows}, indent=1))
    text = table(rows, len(prompts))
    (args.out / "grammar_trees.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
