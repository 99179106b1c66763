"""benchmarks/bench_grammar_walk.py on the tiny model, small: every way of
walking a tree gives the same rows (the script asserts it), and the greedy
way's paths are those over the rows (`rows_walk`); its tables are written."""
from __future__ import annotations

from tests.scripts import benchmark_script


def test_the_walk_benchmark_runs_and_its_ways_agree(tiny_model_dir, tmp_path):
    bench = benchmark_script("bench_grammar_walk")
    assert bench.main(["--model", str(tiny_model_dir), "--nodes", "4", "--trees", "3",
                       "--step-batch", "6", "--repeats", "1", "--workers", "1",
                       "--out", str(tmp_path)]) == 0
    text = (tmp_path / f"walk_{tiny_model_dir.name}.txt").read_text()
    assert "greedy verification's paths" in text and "| 4 |" in text
