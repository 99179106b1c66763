"""Where `grammar_verify: "auto"` on Model Runner V2 leaves no speculation's
output (issue 30; docs/results/v2_grammar_auto_h100: the regex batch's
request 11 took token 311 at position 9 where no speculation takes 17).

Runs the GPU test's sequence (`tests/gpu/test_grammar_trees_cuda.py`, the
`tree_choices` fixture with `"auto"` from 6 trees: the JSON batch, four
alone, then a batch per other constraint with every odd request under it)
without speculation and with the tree, in this process, with the worker's
grammars checked at every use against a fresh matcher advanced by the
request's output read from the device: each verification step's grammars
(`StructuredRequests.verifying_grammars`) and each drafting pass's
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
NUM_PROMPTS, NUM_ALONE, MAX_TOKENS, MIXED_TOKENS = 12, 4, 64, 32
MAX_EVENTS = 400


class GrammarChecks:
    """The hooks' record: every check, the mismatches, the step's way."""

    def __init__(self) -> None:
        self.num_checks = {"verify": 0, "draft": 0}
        self.mismatches: list[dict] = []
        self.pending: list[dict] = []   # a verification step's checks, before its way is known
        self.events: list[dict] = []    # every step's way and the host's decided tokens

    def check(self, where: str, step: int, req_id: str, grammar, tracked, output,
              known: list[int] | None = None) -> dict | None:
        self.num_checks[where] += 1
        same = _same_row(grammar, output)
        if same:
            return None
        entry = {"where": where, "step": step, "req_id": req_id,
                 "num_accepted": tracked.num_accepted if tracked else None,
                 "num_processed": grammar.num_processed_tokens,
                 "terminated": grammar.is_terminated(), "output_len": len(output),
                 "output_tail": [int(t) for t in output[-8:]], "known": known,
                 "unconfirmed": tracked.unconfirmed if tracked else None}
        self.mismatches.append(entry)
        return entry

    def event(self, **kwargs) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(kwargs)


def _same_row(grammar, output) -> bool:
    """Whether `grammar`'s next-token row equals a fresh matcher's advanced
    by `output` (stopping where the fresh one terminates)."""
    import torch
    import xgrammar as xgr

    from vllm_specplug.integration.grammar_trees import _stop_token_ids

    fresh = xgr.GrammarMatcher(grammar.ctx, override_stop_tokens=sorted(_stop_token_ids(grammar)))
    for token in [int(t) for t in output]:
        if fresh.is_terminated():
            break
        if not fresh.accept_token(token):
            return False
    if fresh.is_terminated() or grammar.is_terminated():
        return fresh.is_terminated() == grammar.is_terminated()
    rows = torch.zeros((2, (grammar.vocab_size + 31) // 32), dtype=torch.int32)
    fresh.fill_next_token_bitmask(rows, 0)
    grammar.fill_bitmask(rows, 1)
    return bool(torch.equal(rows[0], rows[1]))


def _device_outputs(structured, req_states, input_batch, req_ids):
    if not req_ids:
        return {}
    row_of = {r: b for b, r in enumerate(input_batch.req_ids[:input_batch.num_reqs])}
    slots = input_batch.idx_mapping_np[:input_batch.num_reqs][[row_of[r] for r in req_ids]]
    return dict(zip(req_ids, structured._outputs(req_states, slots)))


def _cut(structured, req_id, output):
    max_tokens = getattr(structured.params[req_id], "max_tokens", None)
    return output if max_tokens is None else output[:max_tokens]


def install_hooks(checks: GrammarChecks) -> None:
    """Wrap the worker's grammar reads (class attributes: every engine of
    this process) and lift Model Runner V2's refusal of "auto"."""
    from vllm_specplug.integration.grammar_choices import GrammarChoices
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    from vllm_specplug.integration.v2.structured import StructuredRequests
    from vllm_specplug.proposers.eagle3 import TreeOptions

    TreeOptions.check_model_runner_v2 = lambda self: None
    verifying, grammars, rows, correct = (StructuredRequests.verifying_grammars,
                                          StructuredRequests._grammars,
                                          SpecplugV2HeadSpeculator._verification_rows,
                                          GrammarChoices.correct)

    def verifying_grammars(self, req_ids, input_batch, req_states):
        found = verifying(self, req_ids, input_batch, req_states)
        outputs = _device_outputs(self, req_states, input_batch, list(found))
        for req_id, grammar in found.items():
            if outputs[req_id] is None:
                continue
            entry = checks.check("verify", self.step, req_id, grammar,
                                 self.grammars.tracked.get(req_id),
                                 _cut(self, req_id, outputs[req_id]))
            if entry is not None:
                checks.pending.append(entry)
        return found

    def drafting_grammars(self, input_batch, req_states, known=None):
        found = grammars(self, input_batch, req_states, known)
        if found is None:
            return found
        ids = [r for r, g in zip(*found) if g is not None]
        outputs = _device_outputs(self, req_states, input_batch, ids)
        for req_id, grammar in zip(*found):
            if grammar is not None and outputs[req_id] is not None:
                checks.check("draft", self.step, req_id, grammar,
                             self.grammars.tracked.get(req_id),
                             _cut(self, req_id, outputs[req_id]),
                             (known or {}).get(req_id))
        return found

    def verification_rows(self, runner, input_batch, req_ids, grammar_output):
        choices = self.grammar_choices
        before = choices.num_steps_with_rows if choices is not None else 0
        result = rows(self, runner, input_batch, req_ids, grammar_output)
        way = ("rows" if choices is None or choices.num_steps_with_rows > before
               or not choices.planned else "choices")
        for entry in checks.pending:
            entry["way"] = way
        checks.pending = []
        checks.event(kind="verify", step=self.structured.step, way=way, req_ids=list(req_ids),
                     planned=sorted(choices.planned) if choices is not None else [])
        return result

    def corrected(self, logits, target_tokens, input_batch):
        cut = correct(self, logits, target_tokens, input_batch)
        checks.event(kind="emitted", emitted={k: list(v) for k, v in self.emitted.items()},
                     cut=len(cut))
        return cut

    StructuredRequests.verifying_grammars = verifying_grammars
    StructuredRequests._grammars = drafting_grammars
    SpecplugV2HeadSpeculator._verification_rows = verification_rows
    GrammarChoices.correct = corrected


def _runs(llm, prompts, logprobs=None) -> dict:
    """The GPU test's `_runs`: {kind: token ids per request}."""
    from vllm_specplug.engine import greedy_params
    from vllm_specplug.testing.constraints import OUTPUT_PATTERNS, constraint

    def params(kind, max_tokens):
        extra = {"structured_outputs": constraint(kind)} if kind else {}
        return greedy_params(max_tokens, logprobs=logprobs, **extra)

    schema = params("json", MAX_TOKENS)
    runs = {"json": llm.generate(prompts, schema, use_tqdm=False),
            "json-alone": [llm.generate([p], schema, use_tqdm=False)[0]
                           for p in prompts[:NUM_ALONE]]}
    for kind in OUTPUT_PATTERNS:
        runs[kind] = llm.generate(prompts, [params(kind, MIXED_TOKENS) if i % 2 else
                                            params(None, MIXED_TOKENS)
                                            for i in range(len(prompts))], use_tqdm=False)
    return runs


def _engine(work: Path, spec):
    from vllm_specplug.engine import make_llm

    return make_llm(work / "tiny", spec, enforce_eager=False, gpu_memory_utilization=0.3,
                    dtype="float32")


def main() -> None:
    from vllm_specplug.bench.compare import divergences, top2_gaps
    from vllm_specplug.engine import shutdown_llm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", default="auto", choices=["auto", "choices", "rows"])
    parser.add_argument("--min-trees", type=int, default=6)
    args = parser.parse_args()
    work = Path(os.environ.get("SPECPLUG_GPU_WORK", ".gpu/work"))
    prompts = [{"prompt_token_ids": p} for p in
               json.loads((work / "prompts_tiny.json").read_text())[:NUM_PROMPTS]]
    checks = GrammarChecks()
    install_hooks(checks)
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
    (out / f"grammar_auto_diag_{args.verify}.json").write_text(json.dumps(report, indent=1, default=int))
    print(json.dumps({k: report[k] for k in ("verify", "divergences", "num_checks",
                                             "num_mismatches")}, indent=1, default=int))
    print(json.dumps(checks.mismatches[:6], indent=1, default=int))


if __name__ == "__main__":
    main()
