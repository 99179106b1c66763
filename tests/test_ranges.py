"""Our step ranges reach the PyTorch profiler when one runs (`bench offline
--phases` reads them) and cost nothing made when none does."""
from __future__ import annotations

import contextlib

import torch

from vllm_specplug.integration.ranges import profiled_range


def test_a_range_is_recorded_under_the_profiler_and_skipped_without_one():
    assert isinstance(profiled_range("specplug::test"), contextlib.nullcontext)
    with torch.profiler.profile() as profiler:
        with profiled_range("specplug::test"):
            torch.ones(2).sum()
    names = {event.name for event in profiler.events()}
    assert "specplug::test" in names
