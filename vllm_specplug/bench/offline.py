"""Offline benchmark: the same prompts through several speculative configs,
one `vllm.LLM` engine at a time, side by side with no speculation.

For each config and batch size the prompts run in consecutive batches of that
size (the engine's `max_num_seqs` admits the largest), `repeats` times; the
row keeps every repeat's tokens/s, the speculation counters of all repeats and,
under greedy sampling, how many requests' tokens differ from the baseline's at
the same batch size (vLLM's batched numerics may differ from its unbatched).
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from tqdm import tqdm

from vllm_specplug.bench.compare import token_mismatches
from vllm_specplug.bench.specs import NamedSpec
from vllm_specplug.engine import generate, running_llm
from vllm_specplug.metrics import SpecDecodeCounts, read_spec_decode_counts

logger = logging.getLogger("vllm_specplug.bench")
NUM_WARMUP_PROMPTS = 2


@dataclass
class OfflineRow:
    name: str
    batch_size: int
    tokens_per_second: list[float] = field(default_factory=list)  # one per repeat
    counts: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    num_mismatches: int | None = None  # None: not compared (sampling, or failed)
    speedup: float = float("nan")      # median tok/s over the baseline's median
    error: str | None = None
    token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def median_tokens_per_second(self) -> float:
        return statistics.median(self.tokens_per_second) if self.tokens_per_second else 0.0

    @property
    def min_tokens_per_second(self) -> float:
        return min(self.tokens_per_second, default=0.0)


def _run_batches(llm, inputs: list, batch_size: int, params) -> tuple[list, float, int]:
    token_ids, seconds = [], 0.0
    for start in range(0, len(inputs), batch_size):
        result = generate(llm, inputs[start:start + batch_size], params)
        token_ids += result.token_ids
        seconds += result.seconds
    return token_ids, seconds, sum(len(t) for t in token_ids)


def _measure_engine(llm, spec: NamedSpec, inputs, batch_sizes, repeats, params,
                    progress) -> list[OfflineRow]:
    from vllm import SamplingParams

    generate(llm, inputs[:NUM_WARMUP_PROMPTS], SamplingParams(temperature=0, max_tokens=8))
    rows = []
    for batch_size in batch_sizes:
        row = OfflineRow(spec.name, batch_size)
        before = read_spec_decode_counts(llm)
        for repeat in range(repeats):
            token_ids, seconds, num_tokens = _run_batches(llm, inputs, batch_size, params)
            row.tokens_per_second.append(num_tokens / seconds)
            if repeat == 0:
                row.token_ids = token_ids
            progress.update(1)
        row.counts = read_spec_decode_counts(llm) - before
        rows.append(row)
    return rows


def run_offline(model: str, inputs: list, specs: list[NamedSpec], batch_sizes: list[int],
                repeats: int, params, **engine_kwargs) -> list[OfflineRow]:
    """One row per (spec, batch size). The first spec is the baseline; a spec
    whose engine fails gets rows with `error` set and the others go on."""
    engine_kwargs.setdefault("max_num_seqs", max(batch_sizes))
    rows: list[OfflineRow] = []
    total = len(specs) * len(batch_sizes) * repeats
    with tqdm(total=total, desc="bench", unit="run") as progress:
        for spec in specs:
            progress.set_postfix_str(spec.name)
            try:
                with running_llm(model, spec.config,
                                 **{**engine_kwargs, **spec.engine_kwargs}) as llm:
                    rows += _measure_engine(llm, spec, inputs, batch_sizes, repeats,
                                            params, progress)
            except Exception as error:  # one bad config must not lose the others
                logger.error("spec %s failed: %s", spec.name, error)
                rows += [OfflineRow(spec.name, b, error=f"{type(error).__name__}: {error}")
                         for b in batch_sizes]
                progress.update(len(batch_sizes) * repeats)
    _compare_to_baseline(rows, specs[0].name, greedy=params.temperature == 0)
    return rows


def _compare_to_baseline(rows: list[OfflineRow], baseline: str, greedy: bool) -> None:
    base = {r.batch_size: r for r in rows if r.name == baseline and r.error is None}
    for row in rows:
        ref = base.get(row.batch_size)
        if row.error is not None or ref is None:
            continue
        row.speedup = row.median_tokens_per_second / ref.median_tokens_per_second
        if greedy:
            row.num_mismatches = len(token_mismatches(ref.token_ids, row.token_ids))


def side_by_side(model: str, inputs: list, methods: dict[str, dict | None],
                 max_tokens: int, repeats: int = 1, **engine_kwargs) -> list[OfflineRow]:
    """All `inputs` as one greedy batch through each method, `repeats` times;
    the first method must be the baseline (config None)."""
    from vllm import SamplingParams

    names = list(methods)
    if methods[names[0]] is not None:
        raise ValueError("the first method must be the baseline (config None)")
    specs = [NamedSpec(name, methods[name]) for name in names]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return run_offline(str(model), inputs, specs, [len(inputs)], repeats, params,
                       **engine_kwargs)
