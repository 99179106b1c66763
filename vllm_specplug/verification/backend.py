"""Choose between a Triton kernel and its plain-PyTorch reference."""
from __future__ import annotations

import os
from typing import Literal

import numpy as np
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


def to_device(array, device) -> torch.Tensor:
    """A host NumPy array on `device` without synchronising it: on CUDA the
    copy goes through pinned memory and is queued (PyTorch's blocking copy
    from pageable memory waits for the whole stream, which in an engine step
    stalls the host behind the GPU and costs async scheduling its overlap).
    The caching host allocator keeps the pinned block until the copy ran."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
