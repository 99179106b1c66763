"""Where `grammar_verify: "auto"` on Model Runner V2 leaves no speculation's
output (issue 30; docs/results/v2_grammar_auto_h100: the regex batch's
request 11 took token 311 at position 9 where no speculation takes 17).

Runs the GPU test's sequence (`tests/gpu/test_grammar_trees_cuda.py`, the
`tree_choices` fixture with `"auto"` from 6 trees: the JSON batch, four
alone, then a batch per other constraint with every odd request under it)
without speculation and with the tree, in this process, with the worker's
grammars checked at every use against a fresh matcher advanced by the
request's output read from the device (`vllm_specplug.testing.grammar_checks`):
each verification step's grammars (`StructuredRequests.verifying_grammars`) and each drafting pass's
(`StructuredRequests._grammars`). A grammar whose next-token row differs
from the fresh one's is recorded with the step's way (the target's choices
or every node's row), its counts and the tokens the host decided. Model
Runner V2 refuses "auto" at start-up (`TreeOptions.check_model_runner_v2`):
the refusal is lifted here, in this process only. JSON to $OUT.

    python3 benchmarks/gpu/grammar_auto_diag.py [--verify auto|choices] [--min-trees 6]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the hooks need the core here

TREE = {"method": "specplug_eagle3", "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
        "draft_temperature": 0.25, "grammar_drafts": "first", "grammar_rows": "worker",
        "grammar_row_threads": "auto"}
NUM_PROMPTS = 12


def _engine(work: Path, spec):
    from vllm_specplug.engine import make_llm

    return make_llm(work / "tiny", spec, enforce_eager=False, gpu_memory_utilization=0.3,
                    dtype="float32")


def main() -> None:
    from vllm_specplug.bench.compare import divergences, top2_gaps
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.testing.constraints import constrained_runs as _runs
    from vllm_specplug.testing.grammar_checks import worker_grammar_checks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", default="auto", choices=["auto", "choices", "rows"])
    parser.add_argument("--min-trees", type=int, default=6)
    args = parser.parse_args()
    work = Path(os.environ.get("SPECPLUG_GPU_WORK", ".gpu/work"))
    prompts = [{"prompt_token_ids": p} for p in
               json.loads((work / "prompts_tiny.json").read_text())[:NUM_PROMPTS]]
    with worker_grammar_checks(allow_auto_on_v2=True) as checks:
        llm = _engine(work, None)
        try:
            plain = _runs(llm, prompts, logprobs=2)
        finally:
            shutdown_llm(llm)
        spec = {**TREE, "model": str(work / "tiny-eagle3"), "grammar_verify": args.verify}
        if args.verify == "auto":
            spec["grammar_choices_min_trees"] = args.min_trees
        llm = _engine(work, spec)
        try:
            tree = _runs(llm, prompts)
        finally:
            shutdown_llm(llm)
    ids = lambda outputs: [list(o.outputs[0].token_ids) for o in outputs]  # noqa: E731
    found = {kind: divergences(ids(plain[kind]), ids(tree[kind]), top2_gaps(plain[kind]))
             for kind in plain}
    report = {"verify": args.verify, "min_trees": args.min_trees, "divergences": found,
              "num_checks": checks.num_checks, "num_mismatches": len(checks.mismatches),
              "mismatches": checks.mismatches[:60], "events": checks.events}
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"grammar_auto_diag_{args.verify}.json").write_text(
        json.dumps(report, indent=1, default=int))
    print(json.dumps({k: report[k] for k in ("verify", "divergences", "num_checks",
                                             "num_mismatches")}, indent=1, default=int))
    print(json.dumps(checks.mismatches[:6], indent=1, default=int))


if __name__ == "__main__":
    main()
