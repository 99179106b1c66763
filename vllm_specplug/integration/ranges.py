"""Named ranges of our steps for the PyTorch profiler (`bench offline
--phases` reads them: `specplug::decode_step`, `specplug::compact_kv`, ...),
made only while a profiler runs.

`torch.profiler.record_function` enters and leaves a profiler op even when
no profiler listens: 6.2 us a range on this project's CPU, paid every step
by every range of the decode path (issue 26's drafting host time at batch 1
is 0.29-0.33 ms a step on the H100). Checked first, a range costs 0.4 us
when none runs.
"""
from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function


def profiled_range(name: str):
    """`record_function(name)` while a PyTorch profiler runs, else a no-op
    context."""
    if torch._C._autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()
