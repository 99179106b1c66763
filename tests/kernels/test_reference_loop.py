"""The readable speculative loop in docs/ is the specification: with either
backend it must reproduce plain greedy decoding of its target exactly."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

LOOP_PATH = Path(__file__).resolve().parents[2] / "docs" / "reference_loop.py"
VOCAB, HIDDEN, PERIOD = 13, 4, 3


def load_loop():
    spec = importlib.util.spec_from_file_location("reference_loop", LOOP_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def toy_models(seed: int):
    generator = torch.Generator().manual_seed(seed)
    ints = lambda low, high, *shape: torch.randint(low, high, shape, generator=generator).double()
    E, W, U = ints(-3, 4, VOCAB, HIDDEN), ints(1, 3, PERIOD, HIDDEN), ints(-3, 4, HIDDEN, VOCAB)
    draft = (E * W[0]) @ U + torch.randn(VOCAB, VOCAB, generator=generator, dtype=torch.float64)
    prompts = torch.randint(0, VOCAB, (3, 5), generator=generator)
    return (E, W, U), draft, prompts


@pytest.mark.parametrize("topk,depth,num_draft_tokens", [(1, 4, 5), (2, 3, 6), (4, 3, 10)])
@pytest.mark.parametrize("seed", [0, 1])
def test_loop_equals_plain_greedy_with_both_backends(topk, depth, num_draft_tokens, seed,
                                                     device):
    loop = load_loop()
    model, draft, prompts = toy_models(seed)
    num_steps = 8
    results = {}
    with torch.device(device):  # the loop allocates on the default device
        model, draft, prompts = [t.to(device) for t in model], draft.to(device), prompts.to(device)
        for backend in ("torch", "triton"):
            results[backend] = loop.speculative_greedy(model, draft, prompts, num_steps, topk,
                                                       depth, num_draft_tokens, backend=backend)
    assert results["torch"] == results["triton"]
    emitted = [len(tokens) for tokens in results["torch"]]
    assert min(emitted) >= num_steps
    assert sum(emitted) > len(emitted) * num_steps, "no draft token was ever accepted"
    with torch.device(device):
        expected = loop.plain_greedy(model, prompts, max(emitted))
    for ours, reference in zip(results["torch"], expected):
        assert ours == reference[:len(ours)]
