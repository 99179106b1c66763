"""`benchmarks/gpu/record_propose.py` (what a speculator is handed and drafts
in an engine, issue 26's diagnostic on the GPU host) and its comparison
(`record_compare.py`), on CPU: a wrapped `propose` records the real calls
only, a recording survives its files, and the comparison's roots, τ, draft
agreement and hidden-state differences are those of the steps recorded.
The engine run itself needs Model Runner V2 (a CUDA GPU)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

GPU_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(GPU_BENCHMARKS))
    try:
        import record_compare
        import record_propose
        yield record_propose, record_compare
    finally:
        sys.path.remove(str(GPU_BENCHMARKS))


def _batch(positions: list[int], input_ids: list[int]):
    """V2's input batch fields for one request's step (batch 1)."""
    n = len(positions)
    return SimpleNamespace(req_ids=["a"], num_tokens=n, num_reqs=1,
                           input_ids=torch.tensor(input_ids + [0, 0], dtype=torch.int32),
                           positions=torch.tensor(positions + [0, 0]),
                           query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                           seq_lens=torch.tensor([positions[-1] + 1], dtype=torch.int32),
                           idx_mapping=torch.tensor([3]))


class _Speculator:
    """Drafts what it is told; the wrapped class's calls are recorded."""

    def __init__(self, drafts: list[list[int]]) -> None:
        self.drafts = [torch.tensor([d]) for d in drafts]

    def propose(self, input_batch=None, attn_metadata=None, slot_mappings=None, hidden=None,
                aux=None, num_sampled=None, num_rejected=None, last_sampled=None, *rest,
                dummy_run=False, **kwargs):
        return torch.zeros(1, 2, dtype=torch.long) if dummy_run else self.drafts.pop(0)


def _run(record_propose, drafts, aux_shift: float):
    """A prompt of 3 tokens (5 6 7) whose output is 8 9 10 11: a prefill step
    (root 8 at position 3), then a decode step verifying its drafts."""
    class Speculator(_Speculator):
        pass

    recorder = record_propose.Recorder()
    recorder.wrap(Speculator)
    speculator = Speculator(drafts)
    last = torch.zeros(4, 1, dtype=torch.long)
    aux = [torch.arange(10, dtype=torch.float32).reshape(5, 2) + aux_shift]
    speculator.propose(input_batch=None, dummy_run=True)  # V2's warm-up: not recorded
    speculator.propose(_batch([0, 1, 2], [5, 6, 7]), None, None, None, aux,
                       torch.tensor([1]), torch.tensor([0]), last)
    # the decode step: root 8 at 3, drafts 9 12 at 4 5: 9 accepted, 12 rejected,
    # 10 sampled at 5 (the next root)
    speculator.propose(_batch([3, 4, 5], [8, 9, 12]), None, None, None, aux,
                       torch.tensor([2]), torch.tensor([1]), last)
    return recorder.steps


def test_a_recording_compares_roots_tau_drafts_and_hidden_states(scripts, tmp_path):
    record_propose, record_compare = scripts
    for name, drafts, shift in (("a", [[9, 12], [11, 13]], 0.0), ("b", [[9, 4], [2, 13]], 0.5)):
        steps = _run(record_propose, drafts, shift)
        assert len(steps) == 2  # the dummy run left out
        recording = record_propose.Recording()
        for key in ("r0.p0.t0", "r1.p0.t0"):  # a repeat: a file of its own
            recording.add(key, [5, 6, 7], [8, 9, 10, 11], steps)
        recording.save(tmp_path, name, {"spec": {}})
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "a.json", "a.r0.safetensors", "a.r1.safetensors",
        "b.json", "b.r0.safetensors", "b.r1.safetensors"]
    loaded = record_compare.load(tmp_path, "a")["r0.p0.t0"]
    assert sorted(loaded.drafts) == [3, 5]  # roots: after the prefill, after 9 was accepted
    assert [record_compare.accepted(loaded, r) for r in (3, 5)] == [1, 1]
    # rows handed over whose token is the sequence's: 0-2 (prefill), 3-4 (12 at 5 rejected)
    assert sorted(loaded.rows) == [0, 1, 2, 3, 4]
    lines = record_compare.compare(tmp_path, "a", "b").splitlines()
    assert len(lines) == 3 and lines[1].split()[1:] == lines[2].split()[1:]
    line = lines[1].split()
    # outputs the same, 2 steps each, τ 2.0 vs 1.5 (b's draft at root 5 rejected),
    # 2 common roots, drafts agreeing half the time at each depth, 5 rows 0.5 apart
    assert line[:2] == ["r0.p0.t0", "True"]
    assert line[2:5] == ["2/2", "2.000/1.500", "2"]
    assert [float(x) for x in line[5:7]] == [0.5, 0.5]
    assert line[7:] == ["5", "0.5"]
    assert np.array_equal(loaded.token_ids, [5, 6, 7, 8, 9, 10, 11])
