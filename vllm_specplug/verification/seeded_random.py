"""Uniform noise per request, reproducible from its seed: the randomness of
stochastic tree verification on Model Runner V2, where vLLM keeps one seed
per request (`SamplingParams.seed`, or a random one) and derives every
sample from it and the position, so a seeded request gives the same output
run after run. Kernel: `kernels/seeded_random.py` (Triton's `tl.rand`,
Philox 4x32-10); the reference below is the same Philox in NumPy, bit for bit.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.verification.backend import Backend, resolve_backend

BLOCK = 1024
STREAM_STRIDE = 1000003  # as the kernel: key = seed + stream * STREAM_STRIDE
_KEY_A, _KEY_B = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_ROUND_A, _ROUND_B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_MASK32 = np.uint64(0xFFFFFFFF)


def _philox_first_word(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Philox 4x32-10's first output word for uint64 keys [B, 1] and uint32
    counters [C] (the other counter words 0), as Triton's `randint`."""
    with np.errstate(over="ignore"):
        k0 = (keys & _MASK32).astype(np.uint32)
        k1 = (keys >> np.uint64(32)).astype(np.uint32)
        c0 = np.broadcast_to(counters, (keys.shape[0], counters.shape[0])).astype(np.uint32)
        c1 = np.zeros_like(c0)
        c2, c3 = np.zeros_like(c0), np.zeros_like(c0)
        for _ in range(10):
            prod_b = _ROUND_B * c2.astype(np.uint64)
            prod_a = _ROUND_A * c0.astype(np.uint64)
            c0, c2, c1, c3 = ((prod_b >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0,
                              (prod_a >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1,
                              (prod_b & _MASK32).astype(np.uint32),
                              (prod_a & _MASK32).astype(np.uint32))
            k0, k1 = k0 + _KEY_A, k1 + _KEY_B
    return c0


def seeded_uniform_reference(seeds: torch.Tensor, streams: torch.Tensor,
                             num_cols: int) -> torch.Tensor:
    """Plain NumPy/PyTorch specification of `seeded_uniform`."""
    with np.errstate(over="ignore"):
        keys = (seeds.cpu().numpy().astype(np.int64)
                + streams.cpu().numpy().astype(np.int64) * np.int64(STREAM_STRIDE))
    words = _philox_first_word(keys.astype(np.uint64)[:, None],
                               np.arange(num_cols, dtype=np.uint32))
    signed = words.view(np.int32)
    signed = np.where(signed < 0, ~signed, signed)
    uniform = signed.astype(np.float32) * np.float32(4.6566127342e-10)
    return torch.from_numpy(uniform).to(seeds.device)


def seeded_uniform(seeds: torch.Tensor, streams: torch.Tensor, num_cols: int,
                   backend: Backend = "auto") -> torch.Tensor:
    """[B, num_cols] float32 in [0, 1): row b from (seeds[b], streams[b]) alone.

    Args:
        seeds: [B] int64, each request's seed.
        streams: [B] int64, what else the noise depends on (the position a
            request verifies at, or a purpose offset on it).
    """
    if resolve_backend(backend, seeds) == "torch":
        return seeded_uniform_reference(seeds, streams, num_cols)
    from vllm_specplug.kernels.seeded_random import seeded_uniform_kernel

    out = torch.empty(seeds.shape[0], num_cols, dtype=torch.float32, device=seeds.device)
    grid = (seeds.shape[0], -(-num_cols // BLOCK))
    seeded_uniform_kernel[grid](seeds, streams, out, num_cols, BLOCK=BLOCK)
    return out
