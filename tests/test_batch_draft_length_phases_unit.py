"""The batch draft-length policy (adaptive/batch_draft_length.py; issue 27)
on the simulated engine (vllm_specplug/testing/policy_sim.py) where the batch
moves: phases that drain as `bench offline` runs them, step times read
across the batch sizes of a bucket, how often it weighs and tries lengths,
the worker's copy of its times, and the trace of its measured steps. At a
steady batch: tests/test_batch_draft_length_unit.py."""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from vllm_specplug.adaptive.batch_draft_length import BatchDraftLength, draft_length_candidates
from vllm_specplug.adaptive.wave_focus import RequestGains
from vllm_specplug.testing.policy_sim import (RATES, ChainEngine, drain_wave,
                                              expected_over_best, one_step, run_phases,
                                              run_steps, stalling_suffix)


def test_lengths_measured_at_other_batch_sizes_of_one_bucket_are_compared_at_one():
    """SmolLM2 on CPU (docs/results/batch_draft_length_cpu_run3): phases of
    1, 16 and 80 requests, each draining, a step's time growing with its
    requests and tokens. K=0 was timed as the batch-80 phase drained through
    31..16, K=5 in the batch-16 phase: in that bucket K=0 looked slower (81
    vs 77 ms) and was never chosen, where no speculation ran 1.3x faster.
    Here a CPU-like cost where no speculation is best from batch 16 up,
    three rounds of the phases (the first one a warm-up, as `bench offline`
    runs), over twelve seeds: the policy's mean speed at batch 16 and 80 is
    within 4% of the best static length's (0.96x and 0.97x; with the times
    unscaled and one exploration in 32 at any cost, 0.94x and 0.93x), at
    batch 1 within 2%."""
    candidates = draft_length_candidates(5)
    engine_args = dict(rates=[0.35, 0.3, 0.3, 0.3, 0.3], fixed=0.02, per_request=0.002,
                       per_token=0.002, per_draft=5e-4)
    phases = [1, 16, 80] * 3
    static = {k: [] for k in candidates}
    adaptive = []
    for seed in range(12):
        for k in candidates:
            static[k].append(run_phases(ChainEngine(**engine_args, seed=seed), phases,
                                         lambda b, k=k: k, seed)[3:])
        policy = BatchDraftLength(candidates)
        adaptive.append(run_phases(ChainEngine(**engine_args, seed=seed), phases, policy,
                                    seed)[3:])
    ratios = {}
    for i, batch_size in enumerate((1, 16, 80)):
        best = max(np.mean([r[i::3] for r in static[k]]) for k in candidates)
        ratios[batch_size] = np.mean([r[i::3] for r in adaptive]) / best
    assert ratios[1] >= 0.98 and min(ratios[16], ratios[80]) >= 0.96, ratios


def test_step_times_read_every_length_at_the_asked_batch_size():
    """The 16-31 bucket of the CPU run: K=0 timed at 24-31 requests, K=5 at
    16-23, a step's time linear in its requests (K=0 0.6x of K=5 at the same
    batch). Unscaled, K=0 looked the dearer; read at one batch size it is
    0.6x, and the fitted exponent is about 1."""
    from vllm_specplug.adaptive.step_times import StepTimes

    times = StepTimes()
    for i in range(12):
        times.add(0, 24 + i % 8, 0.003 * (24 + i % 8))
        times.add(5, 16 + i % 8, 0.005 * (16 + i % 8))
    assert times.exponent(5) == pytest.approx(1.0, abs=0.01)
    assert times.typical(0, 5, 16) / times.typical(5, 5, 16) == pytest.approx(0.6, rel=0.05)
    assert times.typical(0, 5, 16) == pytest.approx(0.048, rel=0.05)
    # bench's view of the raw windows: the K=0 steps' own batch sizes and times
    window = times.windows()["0@16"]
    assert window["n"] == 12 and window["batch"] == 26.8 and window["q1"] <= window["mean"]
    # where every sample has one batch size there is nothing to fit: taken as it is
    flat = StepTimes()
    for _ in range(12):
        flat.add(0, 30, 0.09)
        flat.add(5, 16, 0.08)
    assert flat.exponent(5) == 0.0 and flat.typical(0, 5, 16) == pytest.approx(0.09)


def test_a_lengths_time_is_the_mean_of_its_steps_without_strays():
    """Suffix on SmolLM2/CPU: with K=5 asked, a step's work depends on how
    many requests found a draft (steps at batch 16 from 90 ms to 2x that;
    lower quartile 90, mean 138, K=0 84). Tokens per second is tokens over
    summed time, so the time is the mean, without steps 3x off the median
    (a capture, a stall; an interval that ended early)."""
    from vllm_specplug.adaptive.step_times import StepTimes

    times = StepTimes()
    for seconds in [0.09, 0.19] * 8 + [2.0, 0.001]:  # the last two: strays
        times.samples.setdefault((5, 5), deque(maxlen=32)).append((16, seconds))
    assert times.typical(5, 5, 16) == pytest.approx(0.14)


def test_a_length_timed_on_a_few_quiet_steps_is_drawn_to_its_buckets_cost_line():
    """Under the 2-core CPU's stalls a few quiet steps priced K=5 at about half
    its cost at batch 80, and the policy ran it on 9% of the phase's steps
    (benchmarks/policy_noise.py, `cpu_phases`). Every drafting length's
    times in the bucket fit a line in K (`StepTimes.line`), and a length's
    own mean is drawn towards it by `LINE_WEIGHT` samples' worth: K=5's three
    quiet steps at half its cost are read more than halfway back to it, a
    length on its full window keeps 80% of its own mean, and no speculation
    (no drafting pass, which the line's intercept holds) keeps its own."""
    from vllm_specplug.adaptive.step_times import LINE_WEIGHT, StepTimes

    times = StepTimes()
    for _ in range(32):  # 0.2 s + 0.02 s a draft, well measured
        for k in (0, 1, 2, 4):
            times.add(k, 80, 0.2 + 0.02 * k)
    for _ in range(3):
        times.add(5, 80, 0.15)  # three quiet steps of a 0.3 s length
    intercept, slope = times.line(80)  # K=5's three steps in it, weighed as three
    assert slope > 0.01 and intercept > 0.19
    k5, _ = times.estimate(5, 80, anchor=4)
    expected = (3 * 0.15 + LINE_WEIGHT * (intercept + 5 * slope)) / (3 + LINE_WEIGHT)
    assert k5 == pytest.approx(expected) and k5 > (0.15 + 0.3) / 2
    assert times.estimate(0, 80, anchor=4)[0] == pytest.approx(0.2)
    # a full window keeps most of its own: 32 / (32 + LINE_WEIGHT)
    own_weight = 32 / (32 + LINE_WEIGHT)
    assert own_weight == pytest.approx(0.8)
    assert times.estimate(2, 80, anchor=4)[0] == pytest.approx(0.24, rel=0.01)
    # a line needs two drafting lengths in the bucket; a slope is never < 0
    lone = StepTimes()
    for _ in range(4):
        lone.add(0, 16, 0.1)
        lone.add(5, 16, 0.2)
    assert lone.line(16) is None and lone.estimate(5, 16, anchor=5)[0] == pytest.approx(0.2)
    for _ in range(4):
        lone.add(4, 16, 0.25)
    assert lone.line(16) == (pytest.approx(0.225), 0.0)


def test_the_workers_copy_holds_the_step_times_sent_only_when_taken_again():
    """Each step's counters cross to the workers' processes; the step times
    (most of their size) come only when the policy took them again, every
    STEP_MS_EVERY decode steps, and the workers' copy (`BatchPolicyView`)
    keeps them in between: after any step it equals the policy's own."""
    from types import SimpleNamespace

    from vllm_specplug.adaptive.batch_draft_stats import STEP_MS_EVERY
    from vllm_specplug.integration.batch_schedule import BATCH_POLICY_ATTR, BatchPolicyView

    policy, view, sent = BatchDraftLength((0, 2, 4)), BatchPolicyView(), []
    for step in range(3 * STEP_MS_EVERY):
        k = policy.choose(8)
        policy.verified(k, [min(k, 2)] * 8)
        policy.measured(k, 8, 0.01 + 0.001 * k)
        counters = policy.counters()
        if "step_ms" in counters:
            sent.append((counters["step_ms"], counters["step_windows"]))
        view.observe_schedule(SimpleNamespace(**{BATCH_POLICY_ATTR: counters}))
        whole = policy.as_dict()
        assert {key: whole[key] for key in counters if not key.startswith("step_")} == {
            key: view.batch_policy[key] for key in counters if not key.startswith("step_")}
        assert (view.batch_policy["step_ms"], view.batch_policy["step_windows"]) == sent[-1]
    assert 3 <= len(sent) <= 4 and sent[-1][0], sent


def test_sizes_the_paths_teach_are_tried_only_for_their_time_now_and_then():
    """A tree whose accepted paths teach every shorter size (`verified_within`)
    tries those sizes a quarter as often (TIME_ONLY_EVERY): a try only
    refreshes their time. Batch 1, 8 drafts about as good as 15 (7 tokens a
    step in 1.18 ms against 8 in 1.32: cheap to try, as on the H200, where
    the adaptive tree tried other sizes 9% of its steps): the steps spent at
    other sizes, with the paths reported and without."""
    def steps_elsewhere(paths: bool) -> int:
        policy = BatchDraftLength((0, 1, 2, 4, 8, 15), chains=False)
        policy.times.pinned = (1e-3, 2e-5)
        ranks = np.array([[0, 1, 2, 3, 4, 5, 14] + [16] * 8])
        elsewhere = 0
        for step in range(3000):
            k = policy.choose(1)
            policy.verified(k, [int((ranks < k).sum())])
            if paths and k > 0:
                policy.verified_within(k, ranks)
            elsewhere += step >= 500 and k != 15
        assert policy.current == 15 and (policy.stats.num_path_steps > 0) == paths
        return elsewhere

    with_paths, without = steps_elsewhere(True), steps_elsewhere(False)
    assert 0 < with_paths <= 0.35 * without, (with_paths, without)


def test_tries_are_rarer_where_a_change_of_length_costs_a_slower_step():
    """A try changes length twice, and where the steps of a change run slower
    than settled ones (CPU: 52 ms against 29 at batch 16), the exploration
    credit pays for that too (`switch_penalty`): batch 16, 8 drafts about as
    good as 15 (cheap to try by their rates alone), switch steps as dear as
    decode steps or 2x: the steps spent at other lengths."""
    def steps_elsewhere(switch_ratio: float) -> int:
        policy = BatchDraftLength((0, 1, 2, 4, 8, 15), chains=False)
        policy.times.pinned = (1e-3, 2e-5 / 16)
        ranks = [0, 1, 2, 3, 4, 5, 14]
        elsewhere, last = 0, None
        for step in range(3000):
            k = policy.choose(16)
            policy.verified(k, [sum(r < k for r in ranks)] * 16)
            seconds = policy.times.estimate(k, 16, k)[0]
            policy.stepped("decode" if k == last else "switch",
                           seconds * (1 if k == last else switch_ratio))
            elsewhere, last = elsewhere + (step >= 500 and k != 15), k
        assert policy.current == 15
        return elsewhere

    dear, even = steps_elsewhere(2.0), steps_elsewhere(1.0)
    assert 0 < dear <= 0.5 * even, (dear, even)


def test_the_8b_projection_keeps_the_policy_near_the_best_static_length():
    """`benchmarks/project_batch_policy.py`: the batch policy against the
    8B shape's measured H100 step costs and the tiny head's acceptance, a
    steady batch of 1, 16 and 64 (docs/results/batch_policy_8b_projection):
    within 3% of the best static candidate length at every batch size, for
    the tree and the chain, in a short run."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import project_batch_policy as projection
    from project_tree_budget import STEPS, load_costs

    rows = projection.project(load_costs(STEPS), steps=800)
    assert {(r["method"], r["batch_size"]) for r in rows} == {
        (m, b) for m in projection.METHODS for b in (1, 16, 64)}
    for r in rows:
        assert r["tokens_per_s"] >= 0.97 * r["best_static"], (r["method"], r["batch_size"],
                                                               r["chosen"])


def test_the_policy_noise_benchmark_writes_each_point(tmp_path, monkeypatch):
    """`benchmarks/policy_noise.py` (docs/results/batch_policy_noise_sim):
    one seed of the GPU-like noisy point and of the draining phases, its
    table, JSON and plot; the
    stalling engine it simulates the CPU with slows some steps 1.5-4x, and
    drafts in bursts make K=5's steps' mean exceed their median."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import policy_noise

    from vllm_specplug.adaptive import step_times

    monkeypatch.setattr(sys, "argv", ["policy_noise.py", "--seeds", "1", "--scenarios",
                                      "gpu_noisy", "cpu_phases", "--out", str(tmp_path),
                                      "--set", "LINE_WEIGHT=4"])
    policy_noise.main()
    written = json.loads((tmp_path / "policy_noise.json").read_text())
    # the constant set for the run, recorded, and put back after it
    assert written["set"] == ["LINE_WEIGHT=4"] and step_times.LINE_WEIGHT == 8.0
    row, *phases = written["rows"]
    assert row["scenario"] == "gpu_noisy" and 0.9 < row["mean"] <= 1.05, row
    # draining phases: a point per phase's batch size, from one run each
    assert [(r["scenario"], r["batch_size"]) for r in phases] == [
        ("cpu_phases", 1), ("cpu_phases", 16), ("cpu_phases", 80)]
    assert all(0.5 < r["mean"] <= 1.2 and 0.5 < r["expected"] <= 1.0 for r in phases), phases
    # `expected`: the steps priced by the cost model's means against the best
    # length at each one's batch size, 1 for those steps themselves
    engine, _ = policy_noise._cpu_phases()
    engine = ChainEngine(**engine, seed=0)
    lengths = draft_length_candidates(5)
    best = {b: max(lengths, key=lambda k: engine.expected_rate(k, b)) for b in (1, 16, 80)}
    assert best == {1: 2, 16: 1, 80: 1}  # as its docstring says
    assert expected_over_best(engine, [(best[b], b) for b in (1, 16, 80)], lengths) == 1.0
    assert expected_over_best(engine, [(5, 80)], lengths) < 0.75
    assert (tmp_path / "policy_noise.png").stat().st_size > 0
    engine = ChainEngine(**stalling_suffix(16), seed=0)
    steps = np.array([engine.seconds(0, 16) for _ in range(400)])
    slow = steps > 1.3 * np.median(steps)
    assert 0.1 < slow.mean() < 0.3 and steps.max() > 3 * np.median(steps)
    # drafts in bursts: a step's own work at K=5 skewed to the slow side
    bursts = ChainEngine(**{**policy_noise._cpu_bursts(16)[0], "stalls": (0.0, 1.0, 1.0)},
                          seed=0)
    steps = np.array([bursts.seconds(5, 16) for _ in range(400)])
    assert steps.mean() > 1.15 * np.median(steps)
    # a drifting host: its speed drawn again every 150 steps, the same for
    # every engine of a seed whatever lengths they run
    quiet = {**policy_noise._cpu_drift(16)[0], "stalls": (0.0, 1.0, 1.0), "noise": 0.0,
             "found": 1.0}
    one, two = ChainEngine(**quiet, seed=3), ChainEngine(**quiet, seed=3)
    speeds = [(one.seconds(0, 16) / two.seconds(5, 16)) for _ in range(600)]
    assert len({round(one.speed, 6), round(two.speed, 6)}) == 1
    assert len(set(np.round(speeds, 9))) == 1  # one ratio of costs: the host is shared
    paths = [one.speed]
    for step in range(600):
        one.seconds(0, 16)
        if step % 150 == 149:
            paths.append(one.speed)
    assert len(set(paths)) == 5 and all(0.75 <= v <= 1.5 for v in paths)


def test_a_time_above_a_bigger_batchs_is_read_at_that_one():
    """The H200's run9: the adaptive tree's first steps at batch 1 (15 and 8
    nodes, timed first) ran 3x slower than the same steps later, and batch
    1 then ran 4 nodes on 98% of its steps, 0.76x of the static tree. Here:
    batch 1 on a host 3x slower until 15 and 8 are timed, then a batch of 3
    (which times 15 nodes again, at more requests), then batch 1 again,
    where 15 nodes is best by about 25%. A step with more requests is never
    faster, so 15's old time at batch 1 is read at batch 3's: 15 nodes on
    at least 85% of the last 300 steps (read as taken: 4 nodes on all but
    the tries)."""
    from vllm_specplug.adaptive.step_times import StepTimes, batch_bucket

    shape = dict(rates=[0.92] * 15, fixed=3e-3, per_token=1e-6, per_draft=1e-4)
    for seed in range(4):
        engine, policy = ChainEngine(**shape, seed=seed, speed=3.0), BatchDraftLength(
            draft_length_candidates(15))
        history = [15, 15]
        while len(policy.times.samples.get((8, batch_bucket(1)), ())) < 3:
            one_step(engine, policy, 1, history)
        engine.speed = 1.0
        run_steps(engine, 1, 100, policy)  # the other lengths timed at batch 1, at full speed
        run_steps(engine, 16, 200, policy)
        before = policy.lengths[15].num_chosen
        run_steps(engine, 1, 300, policy)
        share = (policy.lengths[15].num_chosen - before) / 300
        assert share >= 0.85, (share, policy.as_dict())
    times = StepTimes()  # the cap itself: only ever lower, and only from above
    for _ in range(3):
        times.add(15, 1, 0.014)
        times.add(15, 2, 0.005)
        times.add(15, 4, 0.006)
    assert times.estimate(15, 1, 15) == (pytest.approx(0.005), times.noise(15, 2))
    assert times.estimate(15, 4, 15)[0] == pytest.approx(0.006)


def test_lengths_are_weighed_every_few_steps_and_when_the_batch_moves():
    """Pricing every length is most of the policy's host time (on the H200 its
    engine pinned to one size ran 0.86x of vLLM's table at that size:
    docs/results/batch_draft_length_h200_run10): it weighs them on one step
    in `DECIDE_EVERY`, and at once where the batch moved by more than
    `REWEIGH_BATCH_SHARE` since, keeping the length in between."""
    from vllm_specplug.adaptive.batch_draft_length import DECIDE_EVERY

    policy = BatchDraftLength((0, 4), explore_every=10_000)
    policy.times.pinned = (1e-3, 1e-6)  # every length priced: nothing to measure
    weighed = []
    estimate = policy.times.estimate
    policy.times.estimate = lambda k, b, anchor: weighed.append(b) or estimate(k, b, anchor)
    for _ in range(8 * DECIDE_EVERY):
        policy.choose(16)
    assert len(weighed) == 2 * (1 + 8)  # two lengths priced: the first step, then one in 4
    weighed.clear()
    policy.choose(14)  # a request or two fewer: kept
    policy.choose(8)  # half the batch: weighed at once
    assert weighed == [8, 8] and policy.current == 4


def test_a_settled_policy_reads_one_step_in_sample_every():
    """On the H200 (tiny model, batch 1, host-bound) the adaptive tree ran 15
    nodes on all its steps at 0.32 ms a step over the static tree's 2.77:
    the policy's reading of every step and the paths recorded
    (docs/results/batch_draft_length_h200_run12). Once its weighings kept
    the length `SETTLE_STEPS` steps, the scheduler reads one step in
    `SETTLED_FACTOR` (acceptance and time; a try's steps whole), hands the
    workers the same counters in between, and the policy still runs within
    3% of the best static length; a weighing that moves it unsettles it."""
    from types import SimpleNamespace

    from vllm_specplug.adaptive.batch_draft_length import DECIDE_EVERY, SETTLED_FACTOR
    from vllm_specplug.integration.batch_schedule import BatchDraftSchedule

    policy = BatchDraftLength((0, 1, 2, 4, 8, 15), chains=False)
    scheduler = SimpleNamespace(gains=RequestGains(), draft_length=policy, _channel=None, _shapes_seen=set(),
                                _drafted_before=None, _maybe_log=lambda: None)
    scheduler._first_at_shape = lambda k, out: BatchDraftSchedule._first_at_shape(
        scheduler, k, out)
    idle = dict(rates=[0.95] * 15, fixed=3.4e-3, per_token=1e-7, per_draft=4e-5)  # 15 best
    engine, history = ChainEngine(**idle), [0, 0]

    def run(num_steps: int, num_reqs: int = 1) -> float:
        tokens, elapsed = 0, 0.0
        for _ in range(num_steps):
            counters = policy.step_counters()
            drafted_k = policy[num_reqs]
            verified_k = history[1]
            accepted = engine.accepted(verified_k, num_reqs)
            seconds = engine.seconds(max(verified_k, drafted_k), num_reqs,
                                     settling=verified_k != history[0])
            history[:] = [verified_k, drafted_k]
            spec = {f"r{i}": [7] * verified_k for i in range(num_reqs)}
            output = SimpleNamespace(
                scheduled_spec_decode_tokens={r: ids for r, ids in spec.items() if ids},
                num_scheduled_tokens={r: 1 + verified_k for r in spec},
                total_num_scheduled_tokens=num_reqs * (1 + verified_k),
                finished_req_ids=(), num_spec_tokens_to_schedule=drafted_k)
            runner = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(spec)},
                                     sampled_token_ids=[[1] * (1 + a) for a in accepted])
            BatchDraftSchedule._observe(scheduler, output, runner, seconds)
            tokens, elapsed = tokens + num_reqs + sum(accepted), elapsed + seconds
        return counters, tokens / elapsed

    run(600)
    engine = ChainEngine(**idle, seed=1)  # the static lengths' draws below
    assert policy.current == 15 and policy.sample_every == SETTLED_FACTOR, policy.as_dict()
    read_before, steps_before = policy.acceptance.num_steps, policy.stats.num_steps
    counters, rate = run(400)
    assert policy.step_counters() is counters or policy.stats.num_steps % SETTLED_FACTOR == 0
    read = policy.acceptance.num_steps - read_before
    assert read <= 2 * 400 // SETTLED_FACTOR, (read, policy.as_dict())  # tries read whole
    best = max(run_steps(ChainEngine(**idle, seed=1), 1, 400, lambda b, k=k: k)
               for k in policy.candidates)
    assert rate >= 0.97 * best, (rate, best, policy.as_dict())
    assert policy.stats.num_steps - steps_before == 400
    policy.verified(15, [0] * 2000)  # its drafts stopped being accepted
    for _ in range(DECIDE_EVERY):  # the next weighing moves it, unsettled
        policy[1]
    assert policy.current < 15 and policy.sample_every == 1, policy.as_dict()


def test_no_speculation_is_timed_at_each_batch_not_carried_from_another():
    """SmolLM2 on CPU (docs/results/suffix_drift_cpu): at batch 8 drafting cost
    little over no speculation (59 vs 48 ms a step), at 16 much more (92 vs
    56); the policy carried no speculation's time at 16 over from batch 8 by
    that ratio, never timed it there (one step in 573) and kept K=5, where no
    speculation ran 1.3x faster. Here every length costs the same at batch 8
    (a latency-bound step), and at 16 a step's tokens cost: after batch 8,
    at batch 16 the policy must reach the best static length."""
    candidates = draft_length_candidates(5)
    engine_args = dict(rates=[0.3, 0.2, 0.1, 0.1, 0.1], fixed=1e-3, per_token=1e-3,
                       per_draft=0.0, floor=48e-3)
    static = {k: run_steps(ChainEngine(**engine_args, seed=2), 16, 1500, lambda b, k=k: k)
              for k in candidates}
    policy = BatchDraftLength(candidates)
    engine = ChainEngine(**engine_args, seed=2)
    run_steps(engine, 8, 400, policy)
    adaptive = run_steps(engine, 16, 1500, policy)
    best = max(static, key=static.get)
    assert static[0] > 1.4 * static[5], static  # speculation's longest loses at 16
    assert adaptive >= 0.97 * static[best], (best, static, adaptive, policy.as_dict())


def test_a_draining_wave_is_weighed_by_its_slowest_request():
    """One wave of 16 requests of 48 tokens, nothing waiting, 15 accepting
    70% of drafts and one nothing (suffix decoding on a prompt without
    repeats, docs/results/batch_draft_length_cpu_run14): K=5 gains the batch's
    mean request more than its cost at every batch size, yet the wave ends
    with the request it gains nothing. Weighed by that request
    (`adaptive_focus`, adaptive/wave_focus.py), the policy's waves take about
    as long as no speculation's (within what learning each wave's ratios
    costs), 8% shorter than weighed by the mean."""
    rates = {f"r{i}": 0.7 for i in range(15)} | {"slow": 0.0}
    engine_args = dict(rates=RATES, fixed=0.05, per_token=1e-3, per_draft=0.0, noise=0.02)
    static = {k: sum(drain_wave(ChainEngine(**engine_args, seed=3), k, rates, 48, RequestGains())
                     for _ in range(6)) for k in (0, 5)}
    assert static[0] < 0.85 * static[5]  # the wave's own end: speculation loses here
    times = {}
    for focused in (True, False):
        engine, policy = ChainEngine(**engine_args, seed=3), BatchDraftLength((0, 1, 2, 4, 5))
        gains = RequestGains()
        for _ in range(12):  # learning every length's time at every batch size
            drain_wave(engine, policy, rates, 48, gains)
        if not focused:
            gains.focus = lambda *args: None  # the batch's mean request, as before
        times[focused] = sum(drain_wave(engine, policy, rates, 48, gains) for _ in range(6))
    # (here 20.3 s focused, 22.1 by the mean, 19.0 no speculation, 25.3 K=5:
    # each wave's first steps and its last request's learn their ratios)
    assert times[True] < 0.95 * times[False]
    assert times[True] < 1.10 * static[0]
    assert policy.stats.num_focused > 0


def test_each_measured_step_is_traced_in_order_with_what_was_expected(caplog):
    """`vllm_specplug.policy_trace` at DEBUG: every pure decode step the
    policy measured, in order, with its length, batch, time, the time it
    expected (none before a length has samples) and the host's speed."""
    import logging
    import re

    policy = BatchDraftLength(draft_length_candidates(4))
    engine = ChainEngine(rates=RATES, fixed=4e-3, per_token=2e-5, per_draft=3e-4)
    with caplog.at_level(logging.DEBUG, logger="vllm_specplug.policy_trace"):
        run_steps(engine, 8, 200, policy)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm_specplug.policy_trace"]
    pattern = re.compile(r"measured k=(\d+) batch=8 ms=([\d.]+) expected_ms=(-|[\d.]+) "
                         r"host=([\d.]+) current=(\d+)")
    found = [pattern.fullmatch(line) for line in lines]
    assert lines and all(found), lines[:5]
    assert len(lines) == policy.num_decode_steps
    assert found[0].group(3) == "-"  # nothing measured yet
    priced = [m for m in found if m.group(3) != "-"]
    # what it expected is near what the steps took (3% noise, a steady cost)
    assert priced and all(0.7 < float(m.group(3)) / float(m.group(2)) < 1.3 for m in priced)
    assert {int(m.group(1)) for m in found} <= set(policy.lengths)
