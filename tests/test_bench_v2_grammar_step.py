"""benchmarks/bench_v2_grammar_step.py on the tiny model, small: both ways
run over a few steps with requests replaced as their grammars end, every
step checking the worker's grammars against the reference's and the
choices' tokens against the target's path (the script raises otherwise);
its table is written."""
from __future__ import annotations

import pytest

from tests.scripts import benchmark_script


def test_the_grammar_step_benchmark_runs_both_ways(tiny_model_dir, tmp_path):
    bench = benchmark_script("bench_v2_grammar_step")
    assert bench.main(["--model", str(tiny_model_dir), "--batch", "3", "--steps", "12",
                       "--out", str(tmp_path)]) == 0
    text = (tmp_path / "grammar_step.md").read_text()
    assert "| 3 | rows |" in text and "| 3 | choices |" in text


def test_a_worker_grammar_off_its_output_fails_the_benchmark(tiny_model_dir, monkeypatch):
    """The check can fail: a grammar advanced once more than its output."""
    bench = benchmark_script("bench_v2_grammar_step")
    emit = bench.Batch.emit

    def emit_one_short(self, b, token_ids):  # the reference misses a step's last token
        emit(self, b, token_ids)
        if len(token_ids) > 1 and b == 0:
            self.refs[self.req_ids[b]].rollback(1)

    monkeypatch.setattr(bench.Batch, "emit", emit_one_short)
    with pytest.raises(AssertionError, match="worker grammar at"):
        bench.main(["--model", str(tiny_model_dir), "--batch", "2", "--steps", "12"])
