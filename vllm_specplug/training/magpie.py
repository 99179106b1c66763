"""Training prompts written by the target itself (Magpie: Xu et al. 2024,
"Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing", arXiv 2406.08464).

The target gets its chat template up to the start of a user message and no
more. What it samples there, up to its end-of-turn token, is a user prompt
in the style of its own chat data. A draft head learns the target's answers
to such prompts (`extract --regenerate`), so neither the prompts nor the
answers come from a benchmark.

Prompts that share any word 8-gram with a benchmark's questions
(`exclude`) are dropped, and the report gives the overlap that remains
(zero by construction) next to what was dropped.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger("vllm_specplug.magpie")
OVERLAP_N = 8                  # words per n-gram in the overlap check
MIN_PROMPT_CHARS = 16
_MARKER = "\x00MAGPIE\x00"


@dataclass
class MagpieReport:
    num_sampled: int = 0
    num_kept: int = 0
    num_truncated: int = 0      # hit max_tokens before the end of the turn
    num_short: int = 0
    num_duplicates: int = 0
    num_overlapping: dict = field(default_factory=dict)  # set -> dropped for overlap
    num_unused: int = 0         # sampled after enough prompts were kept
    kept_overlap: dict = field(default_factory=dict)     # set -> shared n-grams kept
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def user_prefix_ids(tokenizer) -> list[int]:
    """The templated conversation up to where a user message's text starts."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}],
                                         tokenize=False, add_generation_prompt=False)
    return tokenizer(text[:text.index(_MARKER)], add_special_tokens=False).input_ids


def word_ngrams(text: str, n: int = OVERLAP_N) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _sample(llm, prefix: list[int], count: int, max_tokens: int, temperature: float):
    """`count` samples after `prefix`, from the engine's seeded generator (no
    per-request seeds: vLLM's CPU sampler fails on them when a batch resumes,
    "CPU Generator does not use offset")."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens)
    return llm.generate([{"prompt_token_ids": prefix}] * count, params, use_tqdm=False)


def _keep(text: str, output, seen: set[str], exclude: dict[str, set], report) -> bool:
    """Whether one sampled prompt joins the set (the report counts why not)."""
    if output.finish_reason != "stop":
        report.num_truncated += 1
        return False
    if len(text) < MIN_PROMPT_CHARS:
        report.num_short += 1
        return False
    key = " ".join(text.lower().split())
    if key in seen:
        report.num_duplicates += 1
        return False
    grams = word_ngrams(text)
    for name, banned in exclude.items():
        if grams & banned:
            report.num_overlapping[name] = report.num_overlapping.get(name, 0) + 1
            return False
    seen.add(key)
    return True


def sample_prompts(llm, num_prompts: int, exclude_texts: dict[str, list[str]],
                   max_tokens: int = 128, temperature: float = 1.0,
                   max_rounds: int = 20) -> tuple[list[str], MagpieReport]:
    """`num_prompts` distinct user prompts sampled from the target (an engine
    made with a fixed `seed` samples the same prompts again)."""
    report, start = MagpieReport(), time.perf_counter()
    exclude = {name: set().union(*map(word_ngrams, texts))
               for name, texts in exclude_texts.items()}
    prefix = user_prefix_ids(llm.get_tokenizer())
    kept: list[str] = []
    seen: set[str] = set()
    with tqdm(total=num_prompts, desc="magpie prompts", unit="prompt") as progress:
        for _ in range(max_rounds):
            if len(kept) >= num_prompts:
                break
            count = max(8, int((num_prompts - len(kept)) * 1.3))
            outputs = _sample(llm, prefix, count, max_tokens, temperature)
            report.num_sampled += count
            for output in outputs:
                sample = output.outputs[0]
                if len(kept) == num_prompts:
                    report.num_unused += 1
                elif _keep(sample.text.strip(), sample, seen, exclude, report):
                    kept.append(sample.text.strip())
                    progress.update(1)
    report.num_kept, report.seconds = len(kept), time.perf_counter() - start
    if len(kept) < num_prompts:  # the caller goes on with fewer; say so
        logger.warning("magpie: kept %d of %d prompts after %d rounds (%s)", len(kept),
                       num_prompts, max_rounds, report.as_dict())
    report.kept_overlap = {name: sum(len(word_ngrams(t) & banned) for t in kept)
                           for name, banned in exclude.items()}
    return kept, report


def write_prompts_file(path: Path, prompts: list[str]) -> Path:
    """JSONL of one-message chats (what `extract --regenerate` reads), atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                           for p in prompts))
    os.replace(tmp, path)
    return path
