"""Model-free drafts under constraints (issue 30, item 2), CPU: does
`specplug_suffix` gain from offering, where vLLM's scheduler would cut its
draft at a forbidden token, the likeliest path of arctic's speculation tree
that the grammar allows (`grammar_drafts`, on by default)? The built-in tiny
model, 24 held-out prompts, 64 greedy tokens, under a JSON schema, a regex
and an EBNF grammar (vllm_specplug/testing/constraints.py); the adaptive
controller off. Exactness against no speculation per constraint.

    .venv/bin/python benchmarks/bench_grammar_free.py --out docs/results/grammar_free_cpu
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

KINDS = ("json", "regex", "grammar")


SUFFIX = {"method": "specplug_suffix", "num_speculative_tokens": 6, "min_token_prob": 0.1,
          "adaptive": False}


def _rows() -> dict:
    return {"none": None, **{f"specplug_suffix grammar_drafts={str(on).lower()}":
                             {**SUFFIX, "grammar_drafts": on} for on in (True, False)}}


def _run(target, config, prompts, expected: dict) -> list[dict]:
    from vllm_specplug.testing.constraints import constraint
    from vllm_specplug.testing.compare import assert_same_tokens
    from vllm_specplug.testing.engine import generate, greedy_params, running_llm
    from vllm_specplug.testing.metrics import read_spec_decode_counts

    results = []
    with running_llm(target, config) as llm:
        for kind in KINDS:
            before = read_spec_decode_counts(llm)
            out = generate(llm, prompts, greedy_params(64, structured_outputs=constraint(kind)))
            counts = read_spec_decode_counts(llm) - before
            if config is None:
                expected[kind] = out.token_ids
                continue
            assert_same_tokens(expected[kind], out.token_ids, prompts)
            steps = out.num_output_tokens - counts.num_accepted_tokens
            results.append({"constraint": kind, "tokens_per_step": out.num_output_tokens / steps,
                            "num_draft_tokens": counts.num_draft_tokens,
                            "num_accepted_tokens": counts.num_accepted_tokens, "exact": True})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vllm_specplug.models import build_model, held_out_prompts

    target, prompts = str(build_model("tiny")), held_out_prompts(24)
    expected, table = {}, {}
    for name, config in tqdm(_rows().items(), desc="engines"):
        table[name] = _run(target, config, prompts, expected)
    lines = [f"{'method':<40} {'constraint':<10} {'tokens/step':>11} {'drafts kept':>11} "
             f"{'accepted':>8}  exact"]
    for name, results in table.items():
        lines += [f"{name:<40} {r['constraint']:<10} {r['tokens_per_step']:>11.3f} "
                  f"{r['num_draft_tokens']:>11} {r['num_accepted_tokens']:>8}  yes"
                  for r in results]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_free.txt").write_text("\n".join(lines) + "\n")
    (out / "grammar_free.json").write_text(json.dumps(table, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
