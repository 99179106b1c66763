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


def _batch(rows: list[tuple[list[int], list[int]]]):
    """V2's input batch fields of a step: (positions, token ids) a request."""
    positions = [x for pos, _ in rows for x in pos]
    cu = np.cumsum([0] + [len(pos) for pos, _ in rows])
    return SimpleNamespace(req_ids=["x", "y"][:len(rows)], num_tokens=len(positions),
                           num_reqs=len(rows),
                           input_ids=torch.tensor([x for _, ids in rows for x in ids] + [0, 0],
                                                  dtype=torch.int32),
                           positions=torch.tensor(positions + [0, 0]),
                           query_start_loc=torch.tensor(cu, dtype=torch.int32),
                           seq_lens=torch.tensor([pos[-1] + 1 for pos, _ in rows],
                                                 dtype=torch.int32),
                           idx_mapping=torch.tensor([3, 1][:len(rows)]))


class _Speculator:
    """Drafts what it is told; the wrapped instance's calls are recorded."""

    def __init__(self, drafts: list[list[list[int]]]) -> None:
        self.drafts = [torch.tensor(d) for d in drafts]

    def propose(self, input_batch=None, attn_metadata=None, slot_mappings=None, hidden=None,
                aux=None, num_sampled=None, num_rejected=None, last_sampled=None, *rest,
                dummy_run=False, **kwargs):
        return torch.zeros(1, 2, dtype=torch.long) if dummy_run else self.drafts.pop(0)


# request x: prompt 5 6 7, output 8 9 10 11; request y: prompt 1 2, output 3 4
PROMPTS = {"x": ([5, 6, 7], [8, 9, 10, 11]), "y": ([1, 2], [3, 4])}


def _run(record_propose, drafts, aux_shift: float, hidden: bool = True, sync: bool = False,
         hidden_features: int | None = None):
    """A step of both prefills (roots 8 at 3 and 3 at 2), then a decode step:
    x verifies 8 9 12 at 3-5 (9 accepted, 12 rejected, 10 sampled at 5, the
    next root), y verifies 3 4 at 2-3 (4 accepted, the bonus at 4)."""
    recorder = record_propose.Recorder(hidden=hidden, sync=sync,
                                       hidden_features=hidden_features)
    speculator = _Speculator(drafts)
    recorder.wrap(speculator)
    last = torch.zeros(4, 1, dtype=torch.long)
    aux = [torch.arange(16, dtype=torch.float32).reshape(8, 2) + aux_shift]
    speculator.propose(input_batch=None, dummy_run=True)  # V2's warm-up: not recorded
    speculator.propose(_batch([([0, 1, 2], [5, 6, 7]), ([0, 1], [1, 2])]), None, None, None,
                       aux, torch.tensor([1, 1]), torch.tensor([0, 0]), last)
    speculator.propose(_batch([([3, 4, 5], [8, 9, 12]), ([2, 3], [3, 4])]), None, None, None,
                       aux, torch.tensor([2, 2]), torch.tensor([1, 0]), last)
    steps = recorder.take()
    assert recorder.take() == []  # taken once
    return steps


def _save(record_propose, path, name, drafts, shift, hidden=True):
    steps = _run(record_propose, drafts, shift, hidden)
    assert len(steps) == 2  # the dummy run left out
    recording, tensors = record_propose.Recording(), record_propose.WaveTensors()
    for repeat in (0, 1):  # a repeat: a file of its own
        key = f"r{repeat}.t0.w0"
        req_ids = tensors.add(key, steps)
        assert req_ids == [["x", "y"], ["x", "y"]]
        recording.add_wave(key, [(f"r{repeat}.p{p}.t0", *PROMPTS[r])
                                 for p, r in enumerate("xy")], req_ids)
    tensors.save(path, name)
    recording.save(path, name, {"spec": {}})


def test_a_recording_compares_roots_tau_drafts_and_hidden_states(scripts, tmp_path):
    record_propose, record_compare = scripts
    _save(record_propose, tmp_path, "a", [[[9, 12], [4, 0]], [[11, 13], [0, 0]]], 0.0)
    _save(record_propose, tmp_path, "b", [[[9, 4], [4, 0]], [[2, 13], [0, 0]]], 0.5)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "a.json", "a.r0.safetensors", "a.r1.safetensors",
        "b.json", "b.r0.safetensors", "b.r1.safetensors"]
    loaded = record_compare.load(tmp_path, "a")
    x, y = loaded["r0.p0.t0"], loaded["r0.p1.t0"]
    assert sorted(x.drafts) == [3, 5]  # roots: after the prefill, after 9 was accepted
    assert [record_compare.accepted(x, r) for r in (3, 5)] == [1, 1]
    assert sorted(y.drafts) == [2, 4] and [record_compare.accepted(y, r) for r in (2, 4)] == [1, 0]
    # rows handed over whose token is the sequence's: x 0-2 (prefill), 3-4 (12 at 5 rejected)
    assert sorted(x.rows) == [0, 1, 2, 3, 4] and sorted(y.rows) == [0, 1, 2, 3]
    assert np.array_equal(x.token_ids, [5, 6, 7, 8, 9, 10, 11])
    lines = record_compare.compare(tmp_path, "a", "b").splitlines()
    assert [line.split()[0] for line in lines[1:5]] == ["r0.p0.t0", "r0.p1.t0",
                                                        "r1.p0.t0", "r1.p1.t0"]
    # a repeat (x and y): 4 steps, 3 drafts accepted by a, 2 by b; turn 0: both repeats
    summary = {line.split()[0]: line.split()[1:] for line in lines[7:11]}
    # and the share of steps accepting each depth's draft: a 3 of 4 at depth 1, b 2
    rates = ["0.750", "0.000", "|", "0.500", "0.000"]
    assert summary == {"r0": ["4/4", "1.750/1.500", *rates], "r1": ["4/4", "1.750/1.500", *rates],
                       "t0": ["8/8", "1.750/1.500", *rates], "all": ["8/8", "1.750/1.500", *rates]}
    line = lines[1].split()
    # outputs the same, 2 steps each, τ 2.0 vs 1.5 (b's draft at root 5 rejected),
    # 2 common roots, drafts agreeing half the time at each depth, 5 rows 0.5 apart
    assert line[1:5] == ["True", "2/2", "2.000/1.500", "2"]
    assert [float(v) for v in line[5:7]] == [0.5, 0.5]
    assert line[7:] == ["5", "0.5"]
    assert lines[2].split()[1:5] == ["True", "2/2", "1.500/1.500", "2"]
    # where they part, by b's step of each request (same outputs: all 4): at
    # step 0, x's drafts share 9 and part at depth 2 (12 / 4), y's are the
    # same; at step 1 x's differ at depth 1 (a's 11 accepted, b's 2 not)
    assert [line.split() for line in lines[-2:]] == [
        ["step", "0", "4", "2", "4", "/", "4"], ["step", "1", "4", "0", "2", "/", "0"]]


def test_a_recording_without_hidden_states_compares_the_drafts(scripts, tmp_path):
    record_propose, record_compare = scripts
    for name in ("a", "b"):
        _save(record_propose, tmp_path, name, [[[9, 12], [4, 0]], [[11, 13], [0, 0]]], 0.0,
              hidden=False)
    line = record_compare.compare(tmp_path, "a", "b").splitlines()[1].split()
    assert line[1:] == ["True", "2/2", "2.000/2.000", "2", "1.00", "1.00", "0", "0"]


@pytest.mark.parametrize("sync", [False, True])
def test_the_recorder_keeps_each_layers_first_features(scripts, sync):
    """Cloned on the device (or copied at once with `sync`), the same steps;
    `hidden_features` keeps each auxiliary layer's first features only."""
    record_propose, _ = scripts
    drafts = [[[9, 12], [4, 0]], [[11, 13], [0, 0]]]
    whole = _run(record_propose, [list(d) for d in drafts], 0.0, sync=sync)
    first = _run(record_propose, [list(d) for d in drafts], 0.0, sync=sync, hidden_features=1)
    assert whole[0]["aux"].shape == (5, 2) and first[0]["aux"].shape == (5, 1)
    assert torch.equal(first[1]["aux"][:, 0], whole[1]["aux"][:, 0])
    assert all(torch.equal(a[k], b[k]) for a, b in zip(whole, first)
               for k in a if k not in ("aux", "req_ids"))


def test_the_worker_extension_records_model_runner_v2s_speculator(scripts, tmp_path):
    """`RecordingWorker` in the engine's process: it wraps the runner's
    speculator, keeps each wave's steps and writes them; a runner without a
    speculator (the V1 runner on CPU) records nothing and writes nothing."""
    record_propose, record_compare = scripts
    speculator = _Speculator([[[9, 12], [4, 0]], [[11, 13], [0, 0]]])
    worker = record_propose.RecordingWorker()
    worker.model_runner = SimpleNamespace(speculator=speculator)
    assert worker.specplug_record_start(True, False, None) == "_Speculator"
    last, aux = torch.zeros(4, 1, dtype=torch.long), [torch.arange(16.0).reshape(8, 2)]
    speculator.propose(_batch([([0, 1, 2], [5, 6, 7]), ([0, 1], [1, 2])]), None, None, None,
                       aux, torch.tensor([1, 1]), torch.tensor([0, 0]), last)
    assert worker.specplug_record_take("r0.t0.w0") == [["x", "y"]]
    assert worker.specplug_record_take("r0.t1.w0") == []  # nothing since
    worker.specplug_record_save(str(tmp_path), "a")
    assert [f.name for f in tmp_path.iterdir()] == ["a.r0.safetensors"]
    bare = record_propose.RecordingWorker()
    bare.model_runner = SimpleNamespace(drafter=speculator)
    assert bare.specplug_record_start(True, False, None) is None
    assert bare.specplug_record_take("r0.t0.w0") == []
    bare.specplug_record_save(str(tmp_path / "bare"), "a")
    assert not (tmp_path / "bare").exists()
