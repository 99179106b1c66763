"""Prompt files for `vllm-specplug bench` (JSONL, one request a line).

    {"messages": [{"role": "user", "content": "..."}]}   chat (templated by the model)
    [{"role": "user", "content": "..."}]                  chat
    {"turns": ["first question", "follow-up", ...]}        chat of several user turns
    {"prompt": "..."}  or  "..."                          plain completion text

Chat lines use the chat format of `vllm-specplug extract`, so one file serves
both; plain prompts go to the model as they are (`/v1/completions` online).
With `turns`, each later turn follows the model's own answer to the one before
(MT-Bench's second turn), so a conversation is generated turn by turn.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vllm_specplug.extraction.prompts import (LineFormatError, _messages_of,
                                              template_for_generation)


@dataclass(frozen=True)
class BenchPrompt:
    messages: list[dict] | None = None     # chat, one answer
    text: str | None = None                # plain completion
    turns: tuple[str, ...] | None = None   # user turns, each after the model's answer
    token_ids: tuple[int, ...] | None = None  # a prompt already tokenized
    json_schema: str | None = None         # JSON text: the schema its answers are held to

    @property
    def label(self) -> str:
        if self.turns is not None:
            return self.turns[0][:40]
        if self.token_ids is not None:
            return f"<{len(self.token_ids)} tokens>"
        return (self.text if self.text is not None else self.messages[-1]["content"])[:40]

    @property
    def num_turns(self) -> int:
        return len(self.turns) if self.turns is not None else 1

    def input_for(self, tokenizer, turn: int = 0, answers: list[str] = ()):
        """What `LLM.generate` takes for `turn` (0-based), after the model's
        `answers` to the turns before it."""
        if self.text is not None:
            return self.text
        if self.token_ids is not None:
            return {"prompt_token_ids": list(self.token_ids)}
        messages = self.messages
        if self.turns is not None:
            messages = []
            for question, answer in zip(self.turns[:turn], answers):
                messages += [{"role": "user", "content": question},
                             {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": self.turns[turn]})
        return {"prompt_token_ids": template_for_generation(tokenizer, messages)}


def sampling_params_for(prompts: list[BenchPrompt], params):
    """`params` for every prompt, or one copy each, held to its own schema,
    where a prompt carries one (vLLM's structured outputs)."""
    if all(p.json_schema is None for p in prompts):
        return params
    from vllm.sampling_params import StructuredOutputsParams

    each = []
    for prompt in prompts:
        copy = params.clone()
        if prompt.json_schema is not None:
            copy.structured_outputs = StructuredOutputsParams(json=prompt.json_schema)
        each.append(copy)
    return each


def bench_prompt_of_input(item) -> BenchPrompt:
    """A `BenchPrompt` of what `LLM.generate` takes: text or token ids."""
    if isinstance(item, str):
        return BenchPrompt(text=item)
    return BenchPrompt(token_ids=tuple(item["prompt_token_ids"]))


class PromptFileError(ValueError):
    pass


def _prompt_of(obj) -> BenchPrompt:
    if isinstance(obj, str) and obj:
        return BenchPrompt(text=obj)
    if isinstance(obj, dict) and "turns" in obj:
        turns = obj["turns"]
        if (not isinstance(turns, list) or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)):
            raise LineFormatError('"turns" must be a list of non-empty strings')
        return BenchPrompt(turns=tuple(turns))
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


def write_bench_prompts(path: str | Path, texts: list[str]) -> Path:
    """A prompts file of plain completion prompts (used for built-in sets)."""
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path
