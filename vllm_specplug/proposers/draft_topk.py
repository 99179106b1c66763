"""A drafting step's top-k draft tokens and their log-probabilities: the
path-score increments of EAGLE-2's tree search (arXiv 2406.16858).

`draft_topk(logits, k, temperature)` for logits [..., V] returns
(log-probs [..., k] float32, descending; ids [..., k] int64) of
log_softmax(logits / temperature). On CUDA one Triton kernel reads each row
once (`kernels/draft_topk.py`); elsewhere the PyTorch reference runs. Ties
may order differently between the two; either way the draft is only a
proposal (verification decides), so any order is lossless.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_specplug.verification.backend import Backend, next_power_of_2, resolve_backend

BLOCK_V = 4096  # vocabulary entries a program reads at a time


def draft_topk_reference(logits: torch.Tensor, k: int, temperature: float = 1.0):
    """log_softmax(logits / temperature) in float32, then its top-k."""
    return F.log_softmax(logits.float() / temperature, dim=-1).topk(k, dim=-1)


def draft_topk(logits: torch.Tensor, k: int, temperature: float = 1.0,
               backend: Backend = "auto"):
    """(logprobs, ids), each [..., k]: see the module docstring."""
    if resolve_backend(backend, logits) == "torch":
        return draft_topk_reference(logits, k, temperature)
    from vllm_specplug.kernels.draft_topk import draft_topk_kernel

    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    logprobs, ids = launch_draft_topk(draft_topk_kernel, rows, k, temperature)
    shape = (*logits.shape[:-1], k)
    return logprobs.view(shape), ids.view(shape)


def launch_draft_topk(kernel, rows: torch.Tensor, k: int, temperature: float = 1.0):
    """(logprobs [n, k] float32, ids [n, k] int64) of `kernel` (the
    `draft_topk_kernel` signature) over rows [n, V], unit stride in V."""
    vocab_size = rows.shape[-1]
    logprobs = torch.empty(rows.shape[0], k, dtype=torch.float32, device=rows.device)
    ids = torch.empty(rows.shape[0], k, dtype=torch.int64, device=rows.device)
    if rows.shape[0]:
        kernel[(rows.shape[0],)](
            rows, logprobs, ids, rows.stride(0), vocab_size, float(temperature), K=k,
            K_PAD=next_power_of_2(k), BLOCK_V=min(BLOCK_V, next_power_of_2(vocab_size)))
    return logprobs, ids
