"""Prompt files for `vllm-specplug bench` (JSONL, one request a line).

    {"messages": [{"role": "user", "content": "..."}]}   chat (templated by the model)
    [{"role": "user", "content": "..."}]                  chat
    {"prompt": "..."}  or  "..."                          plain completion text

Chat lines use the chat format of `vllm-specplug extract`, so one file serves
both; plain prompts go to the model as they are (`/v1/completions` online).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vllm_specplug.extraction.prompts import LineFormatError, _messages_of


@dataclass(frozen=True)
class BenchPrompt:
    messages: list[dict] | None = None  # chat
    text: str | None = None             # plain completion

    @property
    def label(self) -> str:
        return (self.text if self.text is not None else self.messages[-1]["content"])[:40]


class PromptFileError(ValueError):
    pass


def _prompt_of(obj) -> BenchPrompt:
    if isinstance(obj, str) and obj:
        return BenchPrompt(text=obj)
    if isinstance(obj, dict) and "prompt" in obj and "messages" not in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise LineFormatError('"prompt" must be a non-empty string')
        return BenchPrompt(text=obj["prompt"])
    return BenchPrompt(messages=_messages_of(obj))


def read_bench_prompts(path: str | Path, limit: int | None = None) -> list[BenchPrompt]:
    """All usable lines (at most `limit`); a bad line stops with its number,
    since a benchmark on a silently shortened set would mislead."""
    prompts: list[BenchPrompt] = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as error:
        raise PromptFileError(f"--prompts {path}: {error.strerror}") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                prompts.append(_prompt_of(json.loads(line)))
            except (json.JSONDecodeError, LineFormatError) as error:
                raise PromptFileError(f"--prompts {path} line {number}: {error}") from None
            if limit is not None and len(prompts) == limit:
                break
    if not prompts:
        raise PromptFileError(f"--prompts {path}: no prompts in the file")
    return prompts


def engine_inputs(prompts: list[BenchPrompt], tokenizer) -> list:
    """What `LLM.generate` takes: token ids of templated chats, raw text else."""
    from vllm_specplug.extraction.prompts import template_for_generation

    return [p.text if p.text is not None else
            {"prompt_token_ids": template_for_generation(tokenizer, p.messages)}
            for p in prompts]


def write_bench_prompts(path: str | Path, texts: list[str]) -> Path:
    """A prompts file of plain completion prompts (used for built-in sets)."""
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path
