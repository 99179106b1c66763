"""Public benchmark sets (`vllm_specplug/public_sets.py`) as benchmark prompts:
chats of user turns, each later turn after the model's own answer; a set
with a schema (`mt-bench-json`) carries it in every prompt."""
from __future__ import annotations

import json

from vllm_specplug.bench.prompts import BenchPrompt
from vllm_specplug.public_sets import (DERIVED_SETS, PUBLIC_SETS, public_set_schema,
                                       public_set_turns)

__all__ = ["DERIVED_SETS", "PUBLIC_SETS", "load_public_set"]


def load_public_set(name: str, limit: int | None = None) -> list[BenchPrompt]:
    schema = public_set_schema(name)
    schema_text = json.dumps(schema) if schema is not None else None
    return [BenchPrompt(turns=turns, json_schema=schema_text)
            for turns in public_set_turns(name, limit)]
