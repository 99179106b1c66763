"""`bench offline --phases` (bench/phases.py): where a decode step's time goes,
by phase, on the V1 runner and on Model Runner V2's speculators (probed on
stand-ins, no GPU), and the GPU-side reading of a phase's launches."""
from __future__ import annotations


def test_phase_probe_times_the_grammars_own_work_on_model_runner_v2():
    """`--phases` (bench/phases.py): on Model Runner V2 the grammar's host work
    in the worker (vLLM's bitmask, our rows and masks) is one phase,
    "grammar", beside the step, and its waits for the GPU (the drafts' and the
    outputs' host copies) another, "grammar_wait"; a speculator without
    grammars is skipped, and the probe leaves every method as it found it."""
    import time as _time
    from types import SimpleNamespace

    from vllm_specplug.bench.phases import PhaseProbe

    class Structured:
        def root_bitmask(self):
            _time.sleep(0.002)

        def queue_outputs(self):
            _time.sleep(0.001)

        def _queued_outputs(self):
            _time.sleep(0.001)

    class Runner:
        def execute_model(self):
            self.speculator.verification_rows()
            self.structured_outputs_worker.apply_grammar_bitmask()

        def take_draft_token_ids(self):
            _time.sleep(0.001)

        def sample_tokens(self):
            self.speculator.propose()

    Runner.__module__ = "vllm.v1.worker.gpu.model_runner"  # what Model Runner V2's is
    structured = Structured()
    runner = Runner()
    runner.structured_outputs_worker = SimpleNamespace(apply_grammar_bitmask=lambda: _time.sleep(0.001))
    runner.speculator = SimpleNamespace(
        structured=structured, propose=lambda: (structured.root_bitmask(),
                                                structured.queue_outputs()),
        verification_rows=lambda: (_time.sleep(0.001), runner.take_draft_token_ids(),
                                   structured._queued_outputs()))
    probe = PhaseProbe(runner, profile_gpu=False)
    probe.start()
    for _ in range(2):
        runner.execute_model()
        runner.sample_tokens()
    phases = probe.stop()["phases"]
    # 1 + 3 + 2 + 1 ms of grammar work a step, four calls: each method counted
    # once; 2 ms of it waits (inside the rows' call), in two calls
    assert phases["grammar"]["calls"] == 4
    assert 7.0 <= phases["grammar"]["host_ms"] < phases["step"]["host_ms"]
    assert phases["grammar_wait"]["calls"] == 2
    assert 2.0 <= phases["grammar_wait"]["host_ms"] < 3.0
    assert phases["draft"]["calls"] == 1 and phases["forward"]["calls"] == 1
    assert not any(name in vars(structured) for name in ("root_bitmask", "queue_outputs",
                                                          "_queued_outputs"))
    runner.speculator.verification_rows()  # an instance's own attribute: put back, not lost
    # a speculator without grammars (vLLM's, or ours without structured requests)
    runner.speculator = SimpleNamespace(propose=lambda: None)
    probe = PhaseProbe(runner, profile_gpu=False)
    probe.start()
    runner.structured_outputs_worker.apply_grammar_bitmask()
    runner.sample_tokens()
    assert probe.stop()["phases"]["grammar"]["calls"] == 1  # vLLM's bitmask alone


def test_steps_are_timed_by_kind_from_one_to_the_next():
    """`--phases` (bench/step_kinds.py): a step that opens a wave, one where
    prefills (new requests or prompt chunks) run beside decodes, and one where
    every request decodes, each timed to the next step's start; the step
    before a wave's first (idle between waves) and the last go uncounted, and
    a schedule of no tokens is not a step."""
    from types import SimpleNamespace

    from vllm_specplug.bench.report import format_first_steps_table, format_step_kinds_table
    from vllm_specplug.bench.step_kinds import StepClock, step_kind

    def output(new=(), cached=(), counts=None, drafts=None):
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached)),
            num_scheduled_tokens=counts or {}, scheduled_spec_decode_tokens=drafts or {})

    first = output(new=["a", "b"], counts={"a": 40, "b": 30})
    joining = output(new=["c"], cached=["a", "b"], counts={"a": 6, "b": 6, "c": 50},
                     drafts={"a": [1] * 5, "b": [1] * 5})
    chunk = output(cached=["a", "c"], counts={"a": 6, "c": 20}, drafts={"a": [1] * 5})
    decode = output(cached=["a", "c"], counts={"a": 6, "c": 1}, drafts={"a": [1] * 5})
    assert [step_kind(o) for o in (first, joining, chunk, decode)] == [
        "first", "mixed", "mixed", "decode"]
    assert step_kind(output()) is None and step_kind(None) is None
    clock = StepClock()
    # wave 1: first at 0, mixed at 10 ms, mixed at 14, decode at 17, 20; idle;
    # wave 2: first at 100, decode at 108, and the pass ends
    for kind, ms in [("first", 0), ("mixed", 10), (None, 12), ("mixed", 14), ("decode", 17),
                     ("decode", 20), ("first", 100), ("decode", 108)]:
        clock.step(kind, ms / 1e3)
        # each step's phases, in the step that is open: 2 ms of ingest in a first step
        clock.add("forward", 1e-3)
        clock.add("ingest_prefills", 2e-3 if kind == "first" else 0.0)
    summary = clock.summary()
    assert summary["first"]["phases"] == {"forward": 1.0, "ingest_prefills": 2.0}
    # a decode step: its own calls and the call after the schedule of no tokens
    # (the mixed step before it stays open); the pass's last counts too
    assert summary["decode"]["phases"] == {"forward": 1.0, "ingest_prefills": 0.0}
    assert summary["mixed"]["phases"]["forward"] == 1.5
    assert {k: v["num_steps"] for k, v in summary.items()} == {
        "first": 2, "mixed": 2, "decode": 1}
    assert [round(summary[k]["wall_ms"], 6) for k in ("first", "mixed", "decode")] == [
        9.0, 3.5, 3.0]
    row = SimpleNamespace(name="ours", batch_size=64, error=None,
                          phases={"timed": {"step_kinds": summary}})
    table = format_step_kinds_table([row, SimpleNamespace(name="x", batch_size=1, error=None,
                                                          phases={})])
    assert table.splitlines()[-1].split() == ["ours", "64", "2", "9.00", "2", "3.50", "1",
                                              "3.00"]
    assert len(table.splitlines()) == 3  # the row without a probe is left out
    first = format_first_steps_table([row, SimpleNamespace(name="x", batch_size=1, error=None,
                                                           phases={})]).splitlines()
    assert first[0].split()[-3:] == ["ms", "forward", "ingest_prefills"]
    assert first[-1].split() == ["ours", "64", "9.00", "1.000", "2.000"] and len(first) == 3


def test_phase_probe_times_our_head_speculators_steps_with_prefills():
    """On Model Runner V2 the probe also times our head speculator's parts of
    a step with prefills (bench/phases.py, V2_HEAD_PARTS), each its own
    phase; a speculator without them (vLLM's) is left alone."""
    import time as _time
    from types import SimpleNamespace

    from vllm_specplug.bench.phases import PhaseProbe

    class Speculator:
        def __init__(self):
            self.prefix = SimpleNamespace(schedule=lambda: _time.sleep(0.001))

        def propose(self):
            self.prefix.schedule()
            self._adopt_prefixes()
            self._ingest_prefills()
            self._draft()

        def _adopt_prefixes(self):
            _time.sleep(0.001)

        def _ingest_prefills(self):
            _time.sleep(0.002)

        def _draft(self):
            _time.sleep(0.001)

    class Runner:
        def execute_model(self):
            pass

        def sample_tokens(self):
            self.speculator.propose()

    Runner.__module__ = "vllm.v1.worker.gpu.model_runner"
    runner = Runner()
    runner.speculator = Speculator()
    probe = PhaseProbe(runner, profile_gpu=False)
    probe.start()
    runner.execute_model()
    runner.sample_tokens()
    phases = probe.stop()["phases"]
    for name, ms in [("save_prefixes", 1.0), ("adopt_prefixes", 1.0), ("ingest_prefills", 2.0),
                     ("draft_apart", 1.0)]:
        # inside the draft phase (propose), which holds all of them
        assert phases[name]["calls"] == 1, name
        assert ms <= phases[name]["host_ms"] < phases["draft"]["host_ms"], name
    assert 5.0 <= phases["draft"]["host_ms"] and "ingest_decodes" not in phases
    assert "_draft" not in vars(runner.speculator)  # the class's method again
    runner.speculator = SimpleNamespace(propose=lambda: None)  # vLLM's: nothing to wrap
    probe = PhaseProbe(runner, profile_gpu=False)
    probe.start()
    runner.sample_tokens()
    assert set(probe.stop()["phases"]) == {"step", "draft"}


def test_a_phases_gpu_time_is_what_its_launches_ran_on_the_device():
    """The profiled pass's GPU ms per phase (bench/phases.py): the device
    operations queued by the launches under each range on the host, nested
    ranges' included, a graph replay's kernels by its `cudaGraphLaunch`
    (linked to PyTorch ops, they link to none: every graphed phase read
    about 0 GPU ms on the H200). Where no operation matches a launch, the
    operations within each range's own span on the device (not the span
    itself: an eager ingest's GPU time had looked like its wall time)."""
    from types import SimpleNamespace

    from vllm_specplug.bench.phases import _profiled

    def event(name, device_type, start=0.0, end=0.0, children=(), annotation=False, id=0):
        return SimpleNamespace(name=name, device_type=device_type, id=id,
                               time_range=SimpleNamespace(start=start, end=end),
                               cpu_children=list(children), is_user_annotation=annotation)

    cpu, cuda = "DeviceType.CPU", "DeviceType.CUDA"
    launch_a, launch_b = event("cudaLaunchKernel", cpu, id=11), event("cudaLaunchKernel", cpu, id=12)
    graph = event("cudaGraphLaunch", cpu, id=13)
    ingest = event("specplug::ingest", cpu, children=[event("aten::mm", cpu, children=[launch_a]),
                                                      launch_b])
    ranges = [ingest, event("specplug::draft", cpu, children=[ingest, graph]),
              # their copies on the device: as the H200 showed, the outer one
              # spans only kernels of no nested range
              event("specplug::ingest", cuda, 100.0, 2600.0, annotation=True),
              event("specplug::draft", cuda, 2900.0, 3700.0, annotation=True),
              event("vllm::other_range", cuda, 0.0, 9000.0, annotation=True)]  # not a kernel
    operations = [event("kernel_a", cuda, 100.0, 250.0, id=11),
                  event("kernel_b", cuda, 2450.0, 2600.0, id=12),
                  event("graphed_1", cuda, 3000.0, 3400.0, id=13),  # a replay's two kernels
                  event("graphed_2", cuda, 3500.0, 3700.0, id=13),
                  event("outside", cuda, 5000.0, 5100.0, id=99)]
    assert _profiled(SimpleNamespace(events=lambda: ranges + operations)) == (
        {"ingest": (300.0, 2), "draft": (900.0, 3)}, "launch")
    unlinked = [SimpleNamespace(**{**vars(o), "id": 0}) for o in operations]
    assert _profiled(SimpleNamespace(events=lambda: ranges + unlinked)) == (
        {"ingest": (300.0, 2), "draft": (600.0, 3)}, "span")


def test_top_gpu_ops_keep_device_operations_by_time_per_step():
    """The profiled pass's heaviest device operations (bench/phases.py): kernels
    and copies by GPU time per step, host operations left out (their time
    would count their kernels twice), and our phases' ranges (on the device
    they span the idle time between their kernels: the H200's profile of
    docs/results/v2_queued_rows_h200 put them first)."""
    from types import SimpleNamespace

    from vllm_specplug.bench.phases import top_gpu_ops

    def avg(key, device_type, count, us):
        return SimpleNamespace(key=key, device_type=device_type, count=count,
                               self_device_time_total=us)

    averages = [avg("aten::mm", "DeviceType.CPU", 8, 900.0),
                avg("specplug::verify", "DeviceType.CUDA", 4, 6000.0),  # a range, idle included
                avg("_apply_grammar_bitmask_kernel", "DeviceType.CUDA", 4, 400.0),
                avg("Memcpy HtoD (Pageable -> Device)", "DeviceType.CUDA", 4, 1200.0),
                avg("idle", "DeviceType.CUDA", 4, 0.0)]
    rows = top_gpu_ops(averages, num_steps=4, num_ops=5)
    assert [row["name"] for row in rows] == ["Memcpy HtoD (Pageable -> Device)",
                                            "_apply_grammar_bitmask_kernel"]
    assert rows[0]["gpu_ms"] == 0.3 and rows[1]["calls"] == 1.0
    assert len(top_gpu_ops(averages, num_steps=4, num_ops=1)) == 1
