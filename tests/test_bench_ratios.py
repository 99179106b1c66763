"""`vllm-specplug bench ratios` (a row over another within each repeat, by
tokens/s or decode time, offline and online) and `bench online`'s ramps and
rows. No engine."""
from __future__ import annotations

import json

import pytest

from vllm_specplug.cli.main import main


def test_ramp_stages_double_up_and_halve_down():
    from vllm_specplug.bench.ramp import ramp_stages

    assert ramp_stages(1, 256) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 128, 64, 32, 16, 8, 4,
                                   2, 1]
    assert ramp_stages(3, 10) == [3, 6, 10, 6, 3]
    assert ramp_stages(4, 4) == [4]
    with pytest.raises(ValueError, match="--ramp 8 2"):
        ramp_stages(8, 2)


def test_bench_ratios_are_taken_within_each_repeat(tmp_path, capsys):
    """`bench ratios`: a row over another in the same repeat (a repeat that ran
    slow for every row cancels), over several the fastest of them per
    repeat; a missing reference or a file that is not a result is named."""
    from vllm_specplug.bench.ratios import repeat_ratios

    rows = [{"name": "none", "batch_size": 1, "tokens_per_second": [100.0, 50.0, 100.0]},
            {"name": "theirs-a", "batch_size": 1, "tokens_per_second": [200.0, 100.0, 150.0]},
            {"name": "theirs-b", "batch_size": 1, "tokens_per_second": [150.0, 110.0, 300.0]},
            {"name": "ours", "batch_size": 1, "tokens_per_second": [300.0, 110.0, 330.0]},
            {"name": "failed", "batch_size": 1, "tokens_per_second": []}]
    assert repeat_ratios(rows, "ours", ["theirs-a"], 1) == [1.5, 1.1, 2.2]
    assert repeat_ratios(rows, "ours", ["theirs-a", "theirs-b"], 1) == [1.5, 1.0, 1.1]
    assert repeat_ratios(rows, "failed", ["none"], 1) is None
    assert repeat_ratios(rows, "ours", ["none"], 16) is None
    # a run cut short (offline.partial.json): the repeats every row has
    cut = [{**r, "tokens_per_second": r["tokens_per_second"][:2]} if r["name"] == "theirs-b"
           else r for r in rows]
    assert repeat_ratios(cut, "ours", ["theirs-a", "theirs-b"], 1) == [1.5, 1.0]
    assert repeat_ratios(cut, "ours", ["theirs-a"], 1) == [1.5, 1.1, 2.2]
    path = tmp_path / "offline.json"
    path.write_text(json.dumps({"settings": {}, "rows": rows}))
    assert main(["bench", "ratios", str(path), "--over", "theirs-a", "--over", "theirs-b",
                 "--row", "ours"]) == 0
    out = capsys.readouterr().out
    assert "1.10 [1.00-1.50]" in out and "per repeat: 1.50 1.00 1.10" in out
    assert main(["bench", "ratios", str(path), "--over", "vllm"]) == 2
    assert "--over vllm: no such row" in capsys.readouterr().err
    # a run of two prompt sets: rows of one set, named
    two = [{**r, "prompt_set": "a"} for r in rows] + [
        {"name": "none", "batch_size": 1, "tokens_per_second": [10.0, 10.0, 10.0],
         "prompt_set": "b"},
        {"name": "ours", "batch_size": 1, "tokens_per_second": [20.0, 5.0, 30.0],
         "prompt_set": "b"}]
    path.write_text(json.dumps({"settings": {}, "rows": two}))
    assert main(["bench", "ratios", str(path), "--over", "none", "--row", "ours",
                 "--prompt-set", "b"]) == 0
    assert "per repeat: 2.00 0.50 3.00" in capsys.readouterr().out
    assert main(["bench", "ratios", str(path), "--over", "none"]) == 2
    assert "holds the prompt sets a, b: pick one with --prompt-set" in capsys.readouterr().err
    assert main(["bench", "ratios", str(path), "--over", "none", "--prompt-set", "c"]) == 2
    assert "--prompt-set c: not in this result; its sets are a, b" in capsys.readouterr().err
    path.write_text("[1, 2]")
    assert main(["bench", "ratios", str(path), "--over", "none"]) == 2
    assert "not a `bench offline` or `bench online` result JSON" in capsys.readouterr().err


def test_bench_ratios_of_decode_times_are_taken_within_each_repeat(tmp_path, capsys):
    """`bench ratios --decode`: each repeat's decode time (its waves' first
    token to last) instead of its tokens/s, a row over another as the
    inverse of their times; repeats before one without a time count, and a
    result with none at all is refused, naming the way back to tokens/s."""
    from vllm_specplug.bench.ratios import repeat_ratios

    def row(name, decode_ms):
        return {"name": name, "batch_size": 1, "tokens_per_second": [100.0] * 3,
                "repeats": [{"decode_ms": ms} for ms in decode_ms]}

    rows = [row("vllm", [300.0, 600.0, 200.0]), row("ours", [200.0, 500.0, 250.0]),
            row("old", [300.0, None, 100.0])]
    assert repeat_ratios(rows, "ours", ["vllm"], 1, decode=True) == [1.5, 1.2, 0.8]
    assert repeat_ratios(rows, "ours", ["vllm"], 1) == [1.0, 1.0, 1.0]  # tokens/s
    assert repeat_ratios(rows, "old", ["vllm"], 1, decode=True) == [1.0]
    path = tmp_path / "offline.json"
    path.write_text(json.dumps({"settings": {}, "rows": rows}))
    assert main(["bench", "ratios", str(path), "--over", "vllm", "--row", "ours",
                 "--decode"]) == 0
    out = capsys.readouterr().out
    assert "decode speed over vllm" in out and "1.20 [0.80-1.50]" in out
    path.write_text(json.dumps({"settings": {}, "rows": [
        {**r, "repeats": [{"decode_ms": None}]} for r in rows]}))
    assert main(["bench", "ratios", str(path), "--over", "vllm", "--decode"]) == 2
    assert "--decode: no row of this result has its repeats' decode times" in (
        capsys.readouterr().err)


def test_bench_ratios_read_online_rows_one_per_repeat(tmp_path, capsys):
    """`bench online` writes a row per server, load and repeat: `bench
    ratios` folds them by load (a ramp's name or the concurrency), the
    repeats in order, and gives a load with a failed repeat no ratio."""
    def row(name, repeat, seconds, load="steady", concurrency=256, failed=0):
        return {"name": name, "repeat": repeat, "seconds": seconds, "load": load,
                "concurrency": concurrency, "num_output_tokens": 600, "num_failed": failed}

    rows = [row("none", 1, 6.0, "ramp 1-256-1"), row("none", 0, 3.0, "ramp 1-256-1"),
            row("ours", 0, 2.0, "ramp 1-256-1"), row("ours", 1, 2.0, "ramp 1-256-1"),
            row("none", 0, 4.0, concurrency=8), row("ours", 0, 5.0, concurrency=8, failed=1),
            row("none", 0, 4.0, concurrency=1), row("ours", 0, 1.0, concurrency=1)]
    path = tmp_path / "ramp.json"
    path.write_text(json.dumps({"settings": {}, "rows": rows}))
    assert main(["bench", "ratios", str(path), "--over", "none"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("ramp 1-256-1" in line and "per repeat: 1.50 3.00" in line for line in lines)
    assert not any(line.startswith("ours") and " 8 " in line for line in lines)
    assert any(line.split()[:2] == ["ours", "1"] and "per repeat: 4.00" in line for line in lines)


def test_timed_gpu_servers_run_with_graphs_and_start_one_at_a_time(monkeypatch, tmp_path):
    """benchmarks/gpu/ramp_servers.py's servers: no `--enforce-eager` (a timed
    run wants vLLM's graphs), and each healthy before the next starts (on one
    GPU vLLM's memory profiling fails while another engine starts)."""
    from vllm_specplug.testing import server

    events = []

    class Process:
        returncode = 0

        def __init__(self, command, **kwargs):
            self.name = "ours" if "--speculative-config" in command else "none"
            events.append(("start", self.name, "--enforce-eager" in command))

        def poll(self):
            return None

        def terminate(self):
            events.append(("stop", self.name))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(server.subprocess, "Popen", Process)
    monkeypatch.setattr(server, "_wait_healthy", lambda process, base, log, seconds=0:
                        events.append(("healthy", process.name, seconds)))
    specs = {"none": None, "ours": {"method": "specplug_ngram"}}
    with server.serving("model", specs, tmp_path, eager=False, one_at_a_time=True,
                        startup_seconds=600) as urls:
        assert list(urls) == ["none", "ours"]
    assert events[:4] == [("start", "none", False), ("healthy", "none", 600),
                          ("start", "ours", False), ("healthy", "ours", 600)]
    events.clear()
    with server.serving("model", specs, tmp_path):  # tests: eager, all started at once
        pass
    assert events[:2] == [("start", "none", True), ("start", "ours", True)]


def test_online_rows_keep_which_requests_differ_from_the_first_server():
    """`bench online`'s exactness: a row over the first server's row of the
    same load and repeat, with the requests that differ and where (to tell
    the target's own batch-shape near-ties, the same requests in every row,
    from a drafter's fault), a few at most."""
    from vllm_specplug.bench.online import MAX_MISMATCHES_KEPT, OnlineRow, compare_to_first

    texts = [f"answer {i}" for i in range(20)]
    first = OnlineRow("none", 8, 20, num_completed=20, seconds=2.0, num_output_tokens=100,
                      texts=texts)
    ours = OnlineRow("ours", 8, 20, num_completed=20, seconds=1.0, num_output_tokens=100,
                     texts=[t.replace("1", "7") for t in texts])
    compare_to_first([first, ours], "none", greedy=True)
    assert ours.speedup == 2.0 and first.num_mismatches == 0 and first.mismatches == []
    assert ours.num_mismatches == 11  # "answer 1" and 10-19
    assert len(ours.mismatches) == MAX_MISMATCHES_KEPT
    assert ours.mismatches[0].startswith("request 1 : first differs at token 7")


def test_online_requests_where_the_first_server_alone_differs_are_counted_apart():
    """A ramp's reference runs at moving batch shapes and may flip a greedy
    near-tie itself: a request where it alone differs while every other
    server (at least two) agrees is `ref`, any other difference `NO`; with
    one other server nothing is explained so."""
    from vllm_specplug.bench.online import OnlineRow, compare_to_first, first_only
    from vllm_specplug.bench.report import _exact_text
    from vllm_specplug.cli.bench import _explained

    assert first_only(["a", "b", "c"], [["a", "x", "c"], ["a", "x", "y"]]) == {1}
    assert first_only(["a", "b"], [["a", "x"]]) == set()  # one other: no evidence

    def row(name, texts):
        return OnlineRow(name, 4, len(texts), num_completed=len(texts), seconds=1.0,
                         num_output_tokens=10, texts=texts)

    none, theirs = row("none", ["a", "b", "c"]), row("vllm", ["a", "x", "c"])
    ours = row("ours", ["a", "x", "z"])  # request 1: none alone; request 2: ours alone
    compare_to_first([none, theirs, ours], "none", greedy=True)
    assert (theirs.num_mismatches, theirs.num_first_only) == (1, 1)
    assert (ours.num_mismatches, ours.num_first_only) == (2, 1)
    assert _exact_text(theirs.num_mismatches, theirs.num_first_only, "ref") == "ref(1)"
    assert _exact_text(ours.num_mismatches, ours.num_first_only, "ref") == "NO(1)+1r"
    assert _explained(theirs) == theirs.num_mismatches and _explained(ours) < ours.num_mismatches
    pair = [row("none", ["a", "b"]), row("ours", ["a", "x"])]
    compare_to_first(pair, "none", greedy=True)
    assert pair[1].num_first_only == 0 and _exact_text(1, 0, "ref") == "NO(1)"


def test_a_ramps_stages_are_compared_repeat_by_repeat():
    """Per stage, a server's tokens/s over the first server's in the same
    repeat (median over repeats; a stage with a failed request has none),
    and the drafts per drafting request it ran there."""
    from vllm_specplug.bench.online import OnlineRow
    from vllm_specplug.bench.ramp import format_stage_tables, stage_labels, stage_speedups

    def row(name, repeat, seconds, drafts=(0, 0, 0), failed=0):
        stages = [{"concurrency": c, "seconds": t, "num_output_tokens": 100,
                   "num_failed": failed if i == 1 else 0, "num_drafts": 10 if d else 0,
                   "num_draft_tokens": 10 * d, "num_accepted_tokens": 0}
                  for i, (c, t, d) in enumerate(zip((1, 2, 1), seconds, drafts))]
        return OnlineRow(name, 2, 3, load="ramp 1-2-1", repeat=repeat, stages=stages)

    rows = [row("none", 0, (1.0, 1.0, 2.0)), row("ours", 0, (0.5, 2.0, 1.0), (15, 8, 15)),
            row("none", 1, (2.0, 1.0, 1.0)), row("ours", 1, (0.5, 1.0, 1.0), (15, 0, 15),
                                                     failed=1)]
    assert stage_labels([1, 2, 4, 2, 1]) == ["1", "2", "4", "v2", "v1"]
    assert stage_speedups(rows)["ours"] == [[2.0, 4.0], [0.5], [2.0, 1.0]]
    table = format_stage_tables(rows).splitlines()
    ours = [line for line in table if line.startswith("ours")]
    assert ours[0].split()[1:] == ["3.00", "0.50", "1.50"]
    assert ours[1].split()[1:] == ["15.0", "8.0", "15.0"]
    assert format_stage_tables([OnlineRow("none", 4, 3)]) == ""  # a steady load: no stages
