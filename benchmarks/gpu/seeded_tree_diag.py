"""Where seeded tree sampling first differs from no speculation (issue 26,
item 5; `test_seeded_sampling_reproduces_its_output[tree]`).

Runs the GPU test's seeded sampling (8 prompts, temperature 0.8, top-p 0.95,
seed 123, 32 tokens) without speculation, with every log-probability, and
with the test's tree, batched and each differing request alone. At the
first differing token it recomputes vLLM's Gumbel-max from the baseline's
full distribution (`bench/gumbel_noise.py`): the baseline's own draw (a check
of the recomputation), the gap to the tree's token, and the row positions
near the true one whose noise would have drawn the tree's token (a wrong
position would show there). Prints JSON and writes it to $OUT.

    python3 benchmarks/gpu/seeded_tree_diag.py   # on the staged GPU host
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

SAMPLING = {"temperature": 0.8, "top_p": 0.95, "seed": 123, "max_tokens": 32}
TREE = {"method": "specplug_eagle3", "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
        "draft_temperature": 0.25}
NUM_PROMPTS = 8
NEAR_POSITIONS = 20


def _engine(work: Path, spec: dict | None):
    from vllm_specplug.engine import make_llm

    return make_llm(work / "tiny", spec, enforce_eager=False, gpu_memory_utilization=0.3,
                    max_logprobs=-1, compilation_config={"max_cudagraph_capture_size": 1024})


def _sample(llm, prompts, logprobs: int | None = None):
    from vllm import SamplingParams

    from vllm_specplug.engine import generate

    result = generate(llm, prompts, SamplingParams(**SAMPLING, logprobs=logprobs))
    if logprobs is None:
        return result.token_ids, None
    return result.token_ids, [[{t: lp.logprob for t, lp in pos.items()}
                               for pos in out.outputs[0].logprobs] for out in result.outputs]


def _gumbel_max(listed: dict[int, float], seed: int, pos: int) -> tuple[int, dict]:
    """vLLM's draw from the full raw log-probabilities at a row of `pos`."""
    from vllm_specplug.bench.gumbel_noise import gumbel_noise

    ids = np.array(sorted(listed))
    scaled = np.array([listed[t] for t in ids]) / SAMPLING["temperature"]
    order = np.argsort(-scaled)
    probs = np.exp(scaled[order] - scaled[order][0])
    probs /= probs.sum()
    keep = np.zeros(len(ids), dtype=bool)  # top-p: the smallest prefix reaching top_p
    keep[order[:int(np.searchsorted(np.cumsum(probs), SAMPLING["top_p"])) + 1]] = True
    scores = np.where(keep, scaled + gumbel_noise(seed, pos, ids), -math.inf)
    return int(ids[int(np.argmax(scores))]), {"nucleus": int(keep.sum()),
                                             "scores": dict(zip(ids.tolist(), scores.tolist()))}


def _place(prompt_len: int, at: int, listed: dict[int, float], expected: int, actual: int):
    seed, pos = SAMPLING["seed"], prompt_len - 1 + at
    drawn, info = _gumbel_max(listed, seed, pos)
    scores = info["scores"]
    rank = sorted(listed, key=listed.get, reverse=True).index(actual)
    near = [p for p in range(pos - NEAR_POSITIONS, pos + NEAR_POSITIONS + 1)
            if _gumbel_max(listed, seed, p)[0] == actual]
    return {"position": pos, "recomputed_draw": drawn, "expected": expected, "actual": actual,
            "actual_rank": rank, "actual_logprob": listed[actual],
            "expected_logprob": listed[expected], "nucleus": info["nucleus"],
            "gap": scores[expected] - scores[actual], "positions_drawing_actual": near}


def main() -> None:
    from vllm_specplug.engine import shutdown_llm

    work = Path(os.environ.get("SPECPLUG_GPU_WORK", ".gpu/work"))
    ids = json.loads((work / "prompts_tiny.json").read_text())[:NUM_PROMPTS]
    prompts = [{"prompt_token_ids": p} for p in ids]
    llm = _engine(work, None)
    try:
        base, base_lp = _sample(llm, prompts, logprobs=-1)
    finally:
        shutdown_llm(llm)
    llm = _engine(work, {**TREE, "model": str(work / "tiny-eagle3")})
    try:
        tree, _ = _sample(llm, prompts)
        differ = [i for i in range(NUM_PROMPTS) if tree[i] != base[i]]
        alone = {i: _sample(llm, [prompts[i]])[0][0] for i in differ}
        again, _ = _sample(llm, prompts)
    finally:
        shutdown_llm(llm)
    report = {"differ": differ, "tree_again_equal": again == tree, "requests": {}}
    for i in differ:
        at = next(j for j, (a, b) in enumerate(zip(base[i], tree[i])) if a != b)
        report["requests"][i] = {
            "first_difference": at, "baseline": base[i][:at + 3], "tree": tree[i][:at + 3],
            "tree_alone": alone[i][:at + 3], "alone_equals_baseline": alone[i] == base[i],
            **_place(len(ids[i]), at, base_lp[i][at], base[i][at], tree[i][at])}
    text = json.dumps(report, indent=1)
    print(text)
    out = Path(os.environ.get("OUT", "/tmp"))
    (out / "seeded_tree_diag.json").write_text(text)


if __name__ == "__main__":
    main()
