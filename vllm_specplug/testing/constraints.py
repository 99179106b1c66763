"""The structured-output constraints the engine tests and benchmarks run under (issue 30):
a JSON schema, a regex, a choice and a small EBNF grammar, with the pattern
each output must match (cut at 32 tokens where the constraint allows more)."""
from __future__ import annotations

import re

JSON_SCHEMA = {"type": "object", "required": ["name", "age", "tags", "ok"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
    "ok": {"type": "boolean"}}}
REGEX = r"(def|class) [a-z_]{1,12}\(([a-z_]{1,8}(, )?){0,3}\):"
CHOICES = ["return None", "return self", "raise ValueError"]
EBNF = 'root ::= "x = " num (" + " num)*\nnum ::= [0-9]{1,3}'
# what an output of each constraint matches, 32 tokens at most
OUTPUT_PATTERNS = {"regex": REGEX, "grammar": r"x = \d{1,3}( \+ \d{1,3})*( \+ ?)?",
                   "choice": "|".join(re.escape(c) for c in CHOICES)}


def constraint(kind: str):
    """vLLM's `StructuredOutputsParams` for `kind`: json, regex, choice, grammar."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**{"json": {"json": JSON_SCHEMA}, "regex": {"regex": REGEX},
                                      "choice": {"choice": CHOICES},
                                      "grammar": {"grammar": EBNF}}[kind])


def constrained_runs(llm, prompts: list, logprobs: int | None = None, *, max_tokens: int = 64,
                     mixed_tokens: int = 32, num_alone: int = 4) -> dict:
    """The grammar GPU tests' greedy runs (tests/gpu/test_grammar_trees_cuda.py):
    every prompt under the JSON schema batched, the first `num_alone` alone,
    then for each other constraint a batch whose odd requests carry it.
    {kind: vLLM's RequestOutputs} (kinds: json, json-alone, OUTPUT_PATTERNS')."""
    from vllm_specplug.engine import greedy_params

    def params(kind: str | None, num_tokens: int):
        extra = {"structured_outputs": constraint(kind)} if kind else {}
        return greedy_params(num_tokens, logprobs=logprobs, **extra)

    schema = params("json", max_tokens)
    runs = {"json": llm.generate(prompts, schema, use_tqdm=False),
            "json-alone": [llm.generate([p], schema, use_tqdm=False)[0]
                           for p in prompts[:num_alone]]}
    for kind in OUTPUT_PATTERNS:
        runs[kind] = llm.generate(prompts, [params(kind, mixed_tokens) if i % 2 else
                                            params(None, mixed_tokens)
                                            for i in range(len(prompts))], use_tqdm=False)
    return runs
