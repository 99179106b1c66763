"""Kernel tests run the Triton kernels on the GPU when there is one, and under
the Triton interpreter on CPU otherwise (CI). The interpreter is chosen before
any kernel module is imported: `@triton.jit` reads TRITON_INTERPRET then."""
from __future__ import annotations

import os

import pytest
import torch

# whether this file turned the interpreter on (tests/conftest.py keeps it
# away from the engines other test files start)
SETS_INTERPRETER = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if SETS_INTERPRETER:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The largest batch of the kernel tests: 64 on a GPU; 13 under the
# interpreter, which runs each program of the grid in turn in Python (the
# 64-request cases took about 100 s of a CI here). 13 still spans several
# programs and no power of two.
LARGE_BATCH = 64 if DEVICE == "cuda" else 13


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch):
    """`backend="auto"` picks the interpreted kernels in these tests."""
    if SETS_INTERPRETER:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
