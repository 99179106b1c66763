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
