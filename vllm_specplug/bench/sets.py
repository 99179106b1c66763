"""Public benchmark sets (`vllm_specplug/public_sets.py`) as benchmark prompts:
chats of user turns, each later turn after the model's own answer."""
from __future__ import annotations

from vllm_specplug.bench.prompts import BenchPrompt
from vllm_specplug.public_sets import PUBLIC_SETS, public_set_turns

__all__ = ["PUBLIC_SETS", "load_public_set"]


def load_public_set(name: str, limit: int | None = None) -> list[BenchPrompt]:
    return [BenchPrompt(turns=turns) for turns in public_set_turns(name, limit)]
