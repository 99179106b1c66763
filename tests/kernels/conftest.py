"""Kernel tests run the Triton kernels on the GPU when there is one, and under
the Triton interpreter on CPU otherwise (CI). The interpreter is chosen before
any kernel module is imported: `@triton.jit` reads TRITON_INTERPRET then."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
