"""Run the same prompts through several speculative configs, one engine at a
time, and report speed and acceptance side by side against no speculation.

The first method must be the baseline (`None` config): every other row's
ratio and exactness are measured against it in the same run.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_specplug.testing.compare import token_mismatches
from vllm_specplug.testing.engine import generate, greedy_params, running_llm
from vllm_specplug.testing.metrics import SpecDecodeCounts, read_spec_decode_counts

NUM_WARMUP_PROMPTS = 2


@dataclass
class MethodResult:
    name: str
    tokens_per_second: float
    speedup: float  # tokens/s over the baseline's
    counts: SpecDecodeCounts
    num_mismatches: int  # requests whose tokens differ from the baseline


def _measure(model_dir, config, prompts, max_tokens, engine_kwargs):
    params = greedy_params(max_tokens)
    with running_llm(model_dir, config, **engine_kwargs) as llm:
        generate(llm, prompts[:NUM_WARMUP_PROMPTS], greedy_params(8))
        before = read_spec_decode_counts(llm)
        result = generate(llm, prompts, params)
        counts = read_spec_decode_counts(llm) - before
    return result, counts


def run_side_by_side(model_dir, prompts: list[str],
                     methods: dict[str, dict | None], max_tokens: int,
                     **engine_kwargs) -> list[MethodResult]:
    names = list(methods)
    if methods[names[0]] is not None:
        raise ValueError("the first method must be the baseline (config None)")
    rows: list[MethodResult] = []
    baseline = None
    for name in names:
        result, counts = _measure(model_dir, methods[name], prompts, max_tokens,
                                  engine_kwargs)
        if baseline is None:
            baseline = result
        rows.append(MethodResult(
            name, result.tokens_per_second,
            result.tokens_per_second / baseline.tokens_per_second, counts,
            len(token_mismatches(baseline.token_ids, result.token_ids))))
    return rows


def format_table(rows: list[MethodResult]) -> str:
    header = (f"{'method':<16}{'tok/s':>9}{'x base':>8}{'accept len':>12}"
              f"{'drafts':>8}{'exact':>7}  per-position acceptance")
    lines = [header, "-" * len(header)]
    for row in rows:
        per_pos = " ".join(f"{p:.2f}" for p in row.counts.per_position_acceptance)
        length = row.counts.mean_acceptance_length
        length_text = "-" if row.counts.num_drafts == 0 else f"{length:.2f}"
        lines.append(f"{row.name:<16}{row.tokens_per_second:>9.1f}"
                     f"{row.speedup:>8.2f}{length_text:>12}"
                     f"{row.counts.num_drafts:>8}"
                     f"{'yes' if row.num_mismatches == 0 else 'NO':>7}  {per_pos}")
    return "\n".join(lines)
