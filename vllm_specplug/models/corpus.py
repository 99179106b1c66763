"""The offline training corpus: the Python standard library's own sources.

Files are split into train and held-out sets by a stable hash of their name,
so held-out prompts come from files the model never saw.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HELD_OUT_PERCENT = 10
MIN_PROMPT_CHARS = 80


@dataclass(frozen=True)
class Corpus:
    train: tuple[str, ...]
    held_out: tuple[str, ...]
    digest: str  # sha256 over names and contents: part of the model cache key


def _is_held_out(name: str) -> bool:
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100
    return bucket < HELD_OUT_PERCENT


@lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """Top-level `*.py` modules of the running interpreter's stdlib."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib}")
    digest = hashlib.sha256()
    train, held_out = [], []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        digest.update(path.name.encode() + b"\0" + text.encode() + b"\0")
        (held_out if _is_held_out(path.name) else train).append(text)
    return Corpus(tuple(train), tuple(held_out), digest.hexdigest())


def _function_starts(text: str) -> list[str]:
    """Snippets that end just inside a function body: a def line, the
    docstring if any, and the first body line, which is where code models do
    best and where greedy continuations are recognisably code."""
    lines = text.splitlines()
    snippets = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
            snippet = "\n".join(lines[max(0, i - 2): i + 3]) + "\n"
            if len(snippet) >= MIN_PROMPT_CHARS:
                snippets.append(snippet)
    return snippets


def held_out_prompts(num_prompts: int = 24) -> list[str]:
    """`num_prompts` deterministic code prompts from held-out files."""
    return _code_prompts(load_corpus().held_out, num_prompts)


def train_prompts(num_prompts: int) -> list[str]:
    """Code prompts from the files the model was trained on (draft-head data)."""
    return _code_prompts(load_corpus().train, num_prompts)


def chat_conversations(prompts: list[str], with_answers: bool = False) -> list[dict]:
    """`{"messages": [...]}` lines asking to continue each code prompt; with
    answers, the assistant turn is the prompt's own last line (a stand-in
    answer, for data that is not regenerated)."""
    conversations = []
    for prompt in prompts:
        messages = [{"role": "user", "content": f"Continue this code:\n{prompt}"}]
        if with_answers:
            messages.append({"role": "assistant",
                             "content": prompt.rstrip().splitlines()[-1].strip()})
        conversations.append({"messages": messages})
    return conversations


def _code_prompts(texts: tuple[str, ...], num_prompts: int) -> list[str]:
    pools = [_function_starts(text) for text in texts]
    prompts: list[str] = []
    depth = 0
    while len(prompts) < num_prompts and any(depth < len(p) for p in pools):
        # Round-robin over files, so that prompts spread over many modules.
        prompts += [p[depth] for p in pools
                    if depth < len(p) and p[depth] not in prompts]
        depth += 1
    if len(prompts) < num_prompts:
        raise ValueError(f"only {len(prompts)} held-out prompts available")
    return prompts[:num_prompts]


def repetitive_prompts(num_prompts: int = 24, num_lines: int = 12) -> list[str]:
    """A repetitive workload ("repeat and edit this code"): a held-out code
    block shown twice, then the start of a third copy with one name edited.
    Speculation that copies from the context (n-gram, suffix) shines here."""
    blocks = []
    for text in load_corpus().held_out:
        lines = text.splitlines()
        for start in range(0, len(lines) - num_lines, num_lines * 3):
            block = "\n".join(lines[start:start + num_lines])
            if len(block.strip()) > 200 and "def " in block:
                blocks.append(block)
    if len(blocks) < num_prompts:
        raise ValueError(f"only {len(blocks)} repetitive prompts available")
    step = len(blocks) // num_prompts
    chosen = blocks[::step][:num_prompts]
    return [f"{b}\n\n\n{b}\n\n\n{b.splitlines()[0].replace('self', 'this')}\n"
            for b in chosen]
