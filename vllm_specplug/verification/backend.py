"""Choose between a Triton kernel and its plain-PyTorch reference."""
from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: Backend, *tensors: torch.Tensor) -> str:
    """`auto`: Triton on CUDA tensors or under TRITON_INTERPRET=1, else torch."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r}; choose 'auto', 'triton' or 'torch'")
    if backend != "auto":
        return backend
    on_gpu = any(t.is_cuda for t in tensors)
    return "triton" if on_gpu or triton_interpreted() else "torch"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
