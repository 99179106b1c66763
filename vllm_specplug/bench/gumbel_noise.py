"""vLLM's seeded Gumbel noise on Model Runner V2, recomputed on the host.

Model Runner V2 samples by Gumbel-max (`v1/worker/gpu/sample/gumbel.py`):
the token is argmax(processed_logit + g), where g is Gumbel noise hashed
from the request's seed, the row's position and the token id (MurmurHash3's
32-bit mix, then the open uniform of `murmur3_uniform32`). With the noise
known, a seeded sample that two runs drew differently can be placed: the
gap between the two tokens' perturbed scores in the reference run says
whether the flip is a floating-point near-tie (as `NEAR_TIE_GAP` does for
greedy) or a real difference. Used by `compare.sampled_divergences`.
"""
from __future__ import annotations

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)


def _u32(value) -> np.ndarray:
    return (np.asarray(value, dtype=np.uint64) & _MASK32)


def _rotl32(value: np.ndarray, shift: int) -> np.ndarray:
    return ((value << np.uint64(shift)) | (value >> np.uint64(32 - shift))) & _MASK32


def _mix(h: np.ndarray, key: np.ndarray) -> np.ndarray:
    key = (key * np.uint64(0xCC9E2D51)) & _MASK32
    key = (_rotl32(key, 15) * np.uint64(0x1B873593)) & _MASK32
    h = _rotl32(h ^ key, 13)
    return (h * np.uint64(5) + np.uint64(0xE6546B64)) & _MASK32


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & _MASK32
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & _MASK32
    return h ^ (h >> np.uint64(16))


def murmur3_hash32(seed: int, pos: int, token_ids: np.ndarray) -> np.ndarray:
    """[n] uint64 (32-bit values): vLLM's `murmur3_hash32(seed, pos, offset)`
    with domain 0, for each token id as the offset."""
    seed_bits = int(seed) & 0xFFFFFFFFFFFFFFFF  # the int64 seed's two's complement
    h = _mix(_u32(0), _u32(seed_bits & 0xFFFFFFFF))
    h = _mix(h, _u32(seed_bits >> 32))
    h = _mix(h, _u32(int(pos) & 0xFFFFFFFF))
    keys = _u32(np.asarray(token_ids, dtype=np.int64).astype(np.uint64))
    return _fmix32(_mix(np.broadcast_to(h, keys.shape), keys) ^ np.uint64(16))


def uniform32(seed: int, pos: int, token_ids: np.ndarray) -> np.ndarray:
    """[n] float32: `murmur3_uniform32`, (hash + 0.5) * 2**-32 rounded to
    fp32 from its two exact 16-bit halves, as the kernel forms it."""
    random32 = murmur3_hash32(seed, pos, token_ids)
    hi16 = (random32 >> np.uint64(16)).astype(np.float32)
    lo16 = (random32 & np.uint64(0xFFFF)).astype(np.float32)
    return (hi16 * np.float32(1.52587890625e-05)
            + (lo16 + np.float32(0.5)) * np.float32(2.3283064365386963e-10))


def gumbel_noise(seed: int, pos: int, token_ids: np.ndarray) -> np.ndarray:
    """[n] float64: the target's Gumbel noise -log(-log(1 - u)) for each
    token at a row of this position (fp32 path, not drafting). The kernel
    takes log(1 - u) by a series below 0.25; this is the exact value, within
    about 1e-6 of the kernel's."""
    u = uniform32(seed, pos, token_ids).astype(np.float64)
    return -np.log(-np.log1p(-u))


def perturbed_gap(seed: int, pos: int, temperature: float, chosen: tuple[int, float],
                  other: tuple[int, float]) -> float:
    """How far the reference run's draw `chosen` = (token id, log p) led
    `other` in Gumbel-max at this row: (log p_a - log p_b) / T + g_a - g_b.
    Log-probabilities of the raw logits (vLLM's default `raw_logprobs`):
    their difference is the logits' difference."""
    noise = gumbel_noise(seed, pos, np.array([chosen[0], other[0]]))
    return (chosen[1] - other[1]) / temperature + float(noise[0] - noise[1])
