"""What `bench offline` and `bench online` read from their arguments: the
prompt sets (a JSONL file, a public set, a built-in model's set), per-batch
prompt limits, a JSON schema for every answer, and their checks; each
mistake is a ValueError naming the argument and the fix."""
from __future__ import annotations

import json
from pathlib import Path

BUILTIN_PROMPT_SETS = ("held-out", "repeat-edit")  # the built-in tiny model's
# chat sets, from the package index (mt-bench-json: answers under a JSON schema)
PUBLIC_PROMPT_SETS = ("mt-bench", "humaneval", "mt-bench-json", "mt-bench-json-free")


def builtin_prompt_sets():  # built-in model's sets, plain completion text
    from vllm_specplug.models import held_out_prompts
    from vllm_specplug.models.corpus import repetitive_prompts

    return {"held-out": held_out_prompts, "repeat-edit": repetitive_prompts}


def load_prompt_sets(args) -> dict:
    """{--prompts value: its prompts}, each --prompts in the order given."""
    if not args.prompts:
        raise ValueError("--prompts is required: a JSONL file, a public set "
                         f"({', '.join(PUBLIC_PROMPT_SETS)}), or a built-in set "
                         f"({', '.join(BUILTIN_PROMPT_SETS)}) for the built-in model")
    if len(set(args.prompts)) != len(args.prompts):
        raise ValueError(f"--prompts {' '.join(args.prompts)}: a set is given twice")
    return {name: load_prompts(name, args.num_prompts) for name in args.prompts}


def load_prompts(name: str, num_prompts: int | None):
    """The prompts of one --prompts value: a built-in, public or JSONL set."""
    from vllm_specplug.bench.prompts import BenchPrompt, read_bench_prompts

    if name in BUILTIN_PROMPT_SETS:
        texts = builtin_prompt_sets()[name](num_prompts or 24)
        return [BenchPrompt(text=t) for t in texts]
    if name in PUBLIC_PROMPT_SETS:
        from vllm_specplug.bench.sets import load_public_set

        return load_public_set(name, num_prompts)
    return read_bench_prompts(name, num_prompts)


def positive(args, *names) -> None:
    for name in names:
        values = getattr(args, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def prompt_limits(arguments: list[str]) -> dict[int, int]:
    limits = {}
    for argument in arguments:
        batch, _, number = argument.partition("=")
        if not (batch.isdigit() and number.isdigit() and int(batch) > 0 and int(number) > 0):
            raise ValueError(f"--limit-prompts {argument!r}: expected BATCH=N with two "
                             "positive whole numbers, e.g. 1=12")
        limits[int(batch)] = int(number)
    return limits


def json_schema(path: str | None) -> dict | None:
    """--json-schema FILE: a JSON object (the schema), or None without it."""
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--json-schema {path}: no such file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--json-schema {path}: not JSON ({error})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object, e.g. "
                         '{"type": "object", "properties": {...}}')
    return schema


def check_schemas(schema: dict | None, prompt_sets: dict) -> None:
    """--json-schema holds every answer to one schema: refused beside a set
    whose prompts carry their own (one of them would silently win)."""
    own = [name for name, prompts in prompt_sets.items()
           if any(p.json_schema is not None for p in prompts)]
    if schema is not None and own:
        raise ValueError(f"--json-schema and --prompts {', '.join(own)}: that set holds "
                         "its answers to its own schema; drop --json-schema (or run "
                         "that set's -free twin under it)")
