"""Host work per step of the Model Runner V2 adapter's host path, on CPU.

Drives `SpecplugV2Speculator` (host path: mirror, lifecycle, propose,
padding) over stand-ins for Model Runner V2's request states
(`tests/v2_helpers.py`: the fields it reads, same shapes and dtypes) on CPU
tensors, so the time is host work alone, without the wait for a GPU that the
real copy of sampled tokens includes. B requests with P-token prompts, each
step appending 6 accepted tokens per request.

    .venv/bin/python benchmarks/bench_v2_host_path.py --batch 64 --prompt-len 512
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP_TOKENS = [8, 7, 8, 7, 8, 7]
OPTIONS = {"specplug_hybrid": {"proposers": [{"method": "specplug_suffix"},
                                             {"method": "specplug_ngram"}]}}


def speculator(method: str, states, batch: int, max_len: int, k: int):
    import torch

    from vllm_specplug.integration.config import attach, translate
    from vllm_specplug.integration.v2.speculator import SpecplugV2Speculator

    _, selection = translate({"method": method, "num_speculative_tokens": k,
                              **OPTIONS.get(method, {})})
    spec = SimpleNamespace(num_speculative_tokens=k)
    attach(spec, selection)
    config = SimpleNamespace(
        speculative_config=spec, device_config=SimpleNamespace(device="cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=batch),
        model_config=SimpleNamespace(max_model_len=max_len, get_vocab_size=lambda: 128256))
    return SpecplugV2Speculator(config, torch.device("cpu"), states, use_device_drafter=False)


def measure(method: str, batch: int, prompt_len: int, steps: int) -> float:
    import tests.v2_helpers as helpers

    max_len = prompt_len + 1 + len(STEP_TOKENS) * (steps + 1)
    helpers.MAX_LEN = max_len
    states = helpers.States(max_num_reqs=batch)
    spec = speculator(method, states, batch, max_len, 5)
    rng = random.Random(0)
    req_ids = [f"r{i}" for i in range(batch)]
    for slot, req_id in enumerate(req_ids):
        states.add(req_id, slot, [rng.randrange(1000, 1400) for _ in range(prompt_len)])
        states.sample(req_id, [7])
    helpers.step(spec, states, req_ids, [1] * batch)        # starts every request
    started = time.perf_counter()
    for _ in range(steps):
        for req_id in req_ids:
            states.sample(req_id, STEP_TOKENS)
        helpers.step(spec, states, req_ids, [len(STEP_TOKENS)] * batch)
    return 1000 * (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--methods", nargs="+",
                        default=["specplug_ngram", "specplug_suffix", "specplug_hybrid"])
    args = parser.parse_args()
    for method in args.methods:
        ms = measure(method, args.batch, args.prompt_len, args.steps)
        print(f"{method:18s} batch {args.batch}: {ms:.2f} ms of host work per step")


if __name__ == "__main__":
    main()
