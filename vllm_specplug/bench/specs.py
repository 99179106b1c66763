"""`--spec` arguments of `vllm-specplug bench`: named speculative configs.

    --spec '{"method": "specplug_suffix", "num_speculative_tokens": 4}'
    --spec suffix4='{"method": "suffix", "num_speculative_tokens": 4}'
    --spec @my_spec.json            (a file holding the JSON object)

The row name is the part before `=`, or else the method (numbered when two
specs share it). Configs are checked before any engine starts: JSON, an
object with a `method`, and, for our methods, every option.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

BASELINE_NAME = "none"
_NAMED = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)=(?P<body>.*)$", re.S)


class SpecError(ValueError):
    """A `--spec` argument that cannot be used; the message names it."""


@dataclass(frozen=True)
class NamedSpec:
    name: str
    config: dict | None  # None: no speculation
    # `vllm.LLM` arguments for this row's engine only (e.g. async_scheduling)
    engine_kwargs: dict = field(default_factory=dict)


def _body_text(body: str, argument: str) -> str:
    if not body.startswith("@"):
        return body
    try:
        return Path(body[1:]).read_text()
    except OSError as error:
        raise SpecError(f"--spec {argument!r}: cannot read {body[1:]}: "
                        f"{error.strerror}") from None


def parse_spec(argument: str) -> tuple[str | None, dict]:
    """(name or None, config) of one `--spec` argument, validated."""
    match = _NAMED.match(argument.strip())
    name, body = (match["name"], match["body"]) if match else (None, argument.strip())
    text = _body_text(body, argument)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise SpecError(f"--spec {argument!r}: not JSON ({error.msg} at column "
                        f"{error.colno}); write NAME='{{\"method\": ...}}' or @FILE") from None
    if not isinstance(config, dict) or not isinstance(config.get("method"), str):
        raise SpecError(f"--spec {argument!r}: expected a JSON object with a "
                        '"method", e.g. {"method": "specplug_ngram", '
                        '"num_speculative_tokens": 4}')
    _check_config(argument, config)
    return name, config


def _check_config(argument: str, config: dict) -> None:
    from vllm_specplug.integration.config import translate
    from vllm_specplug.proposers.base import ProposerConfigError

    try:
        translate(config)  # unknown methods and our methods' options
    except ProposerConfigError as error:
        raise SpecError(f"--spec {argument!r}: {error}") from None


def named_specs(arguments: list[str], with_baseline: bool = True) -> list[NamedSpec]:
    """The baseline first, then each `--spec` with a unique row name."""
    specs = [NamedSpec(BASELINE_NAME, None)] if with_baseline else []
    taken = {s.name for s in specs}
    for argument in arguments:
        name, config = parse_spec(argument)
        if name is None:
            name = config["method"]
            number = 2
            while name in taken:
                name, number = f"{config['method']}#{number}", number + 1
        elif name in taken:
            raise SpecError(f"--spec {argument!r}: the name {name!r} is used twice")
        taken.add(name)
        specs.append(NamedSpec(name, config))
    return specs


def _keeps_global_suffix_cache(config: dict) -> bool:
    """Whether a config's suffix tree also holds earlier requests' outputs:
    vLLM's `suffix_decoding_max_cached_requests` or our `max_cached_requests`
    is left at its default (non-zero) or set to anything but 0."""
    method = config.get("method")
    if method == "suffix":
        return config.get("suffix_decoding_max_cached_requests") != 0
    if method == "specplug_suffix":
        return config.get("max_cached_requests") != 0
    if method == "specplug_hybrid":
        return any(_keeps_global_suffix_cache(entry) for entry in config.get("proposers", [])
                   if isinstance(entry, dict))
    return False


def replayed_suffix_cache_rows(specs: list[NamedSpec], num_passes: int) -> list[str]:
    """Rows whose τ a benchmark would inflate: with a global suffix cache and
    more than one pass over the same prompts (warm-up runs + repeats), a pass
    drafts from the outputs of the same prompts in earlier passes, which a
    server answering new questions never sees (measured on SmolLM2, MT-Bench:
    τ 5.3 with the cache against 1.5-1.9 without)."""
    if num_passes <= 1:
        return []
    return [s.name for s in specs if s.config and _keeps_global_suffix_cache(s.config)]
