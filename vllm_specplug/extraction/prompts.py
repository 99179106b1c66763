"""Prompt files (JSONL of chat conversations) and their chat-templated tokens.

One line per sample, any of:
    {"messages": [{"role": "user", "content": "..."}, ...]}
    [{"role": "user", "content": "..."}, ...]
    {"prompt": "..."}                      (one user message)
Roles: system, user, assistant. A bad line is reported with its line number
and skipped; the rest of the file goes on.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PromptLine:
    line_number: int             # 1-based, as editors show it
    sample_id: str
    messages: list[dict]


@dataclass(frozen=True)
class LineError:
    line_number: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line_number}: {self.message}"


@dataclass
class Templated:
    input_ids: list[int]
    loss_mask: list[int]         # 1 on assistant-response tokens


class LineFormatError(ValueError):
    pass


def _messages_of(obj) -> list[dict]:
    if isinstance(obj, dict) and "messages" in obj:
        obj = obj["messages"]
    elif isinstance(obj, dict) and "prompt" in obj:
        obj = [{"role": "user", "content": obj["prompt"]}]
    if not isinstance(obj, list) or not obj:
        raise LineFormatError('expected {"messages": [...]}, a list of messages or '
                              '{"prompt": "..."} with at least one message')
    for i, message in enumerate(obj):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise LineFormatError(f"message {i}: role must be one of {ROLES}")
        if not isinstance(message.get("content"), str):
            raise LineFormatError(f"message {i}: content must be a string")
    if not any(m["content"].strip() for m in obj if m["role"] != "assistant"):
        raise LineFormatError("empty prompt: no non-empty system or user message")
    return [{"role": m["role"], "content": m["content"]} for m in obj]


def sample_id_of(line_number: int, text: str) -> str:
    digest = hashlib.sha1(text.strip().encode()).hexdigest()[:10]
    return f"L{line_number:07d}-{digest}"


def read_prompt_file(path: str | Path) -> tuple[list[PromptLine], list[LineError]]:
    lines, errors = [], []
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                messages = _messages_of(json.loads(text))
            except json.JSONDecodeError as error:
                errors.append(LineError(number, f"malformed JSON ({error.msg} at "
                                                f"column {error.colno})"))
                continue
            except LineFormatError as error:
                errors.append(LineError(number, str(error)))
                continue
            lines.append(PromptLine(number, sample_id_of(number, text), messages))
    return lines, errors


def _ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    # The template writes any BOS itself.
    return tokenizer(text, add_special_tokens=False).input_ids


def template_for_generation(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt tokens for the target to write the final assistant turn."""
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return _ids(tokenizer, messages, add_generation_prompt=True)


def template_conversation(tokenizer, messages: list[dict]) -> Templated:
    """Tokens of a whole conversation, with the assistant turns masked in.

    Each assistant turn spans from the end of the templated conversation before
    it (with the generation prompt) to the end of the conversation including it.
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise LineFormatError("no assistant message to learn from; add one or "
                              "pass --regenerate to have the target write it")
    input_ids = _ids(tokenizer, messages, add_generation_prompt=False)
    loss_mask = [0] * len(input_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _checked_prefix(tokenizer, messages[:i], True, input_ids)
        end = _checked_prefix(tokenizer, messages[:i + 1], False, input_ids)
        loss_mask[start:end] = [1] * (end - start)
    return Templated(input_ids, loss_mask)


def _checked_prefix(tokenizer, messages, add_generation_prompt, input_ids) -> int:
    ids = _ids(tokenizer, messages, add_generation_prompt) if messages else []
    if input_ids[:len(ids)] != ids:
        raise LineFormatError(
            "the chat template does not tokenize turn by turn (a prefix of the "
            "conversation tokenizes differently inside it); loss masks need it")
    return len(ids)


def with_response(prompt_ids: list[int], response_ids: list[int]) -> Templated:
    return Templated(list(prompt_ids) + list(response_ids),
                     [0] * len(prompt_ids) + [1] * len(response_ids))
