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


def test_chains_fill_our_chains_rows_and_refuse_the_choices(tiny_model_dir, tmp_path):
    """`--chain K`: our chain's rows (no parents handed over, `RowDepth`),
    the worker's grammars checked every step as for trees; the target's
    choices need a tree's parents, so they are refused by name."""
    bench = benchmark_script("bench_v2_grammar_step")
    assert bench.Shape(1, 5).parents == [-1, 0, 1, 2, 3, 4]
    assert bench.main(["--model", str(tiny_model_dir), "--chain", "5", "--ways", "rows",
                       "--batch", "3", "--steps", "12", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "grammar_step.md").read_text()
    assert "chains of 5 drafts" in text and "| 3 | rows |" in text
    with pytest.raises(SystemExit):
        bench.main(["--model", str(tiny_model_dir), "--chain", "5", "--batch", "3"])


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


def test_auto_switching_step_by_step_keeps_every_grammar_at_its_output(tiny_model_dir):
    """`grammar_verify: "auto"` on Model Runner V2's worker, its way drawn
    at random each step (the target's choices or every node's row), a
    request in five left to the scheduler's rows, requests replaced as
    their grammars end: every worker grammar in its output's state wherever
    it is used (`worker_grammar_checks`) and after each drafting pass (the
    benchmark's own check), every decided token confirmed by the output.
    Model Runner V2 still refuses "auto" (an H100 differed from no
    speculation twice, docs/results/v2_grammar_auto_h100): this is the
    worker's host side alone."""
    from vllm_specplug.integration.scheduler import SpecplugTreeAsyncScheduler
    from vllm_specplug.testing.grammar_checks import worker_grammar_checks
    from vllm_specplug.testing.scheduler_sim import make_scheduler

    bench = benchmark_script("bench_v2_grammar_step")
    from bench_grammar_walk import make_grammar_factory  # put on the path by the script

    vocab_size, new_grammar = make_grammar_factory(tiny_model_dir)
    vllm_config = make_scheduler(SpecplugTreeAsyncScheduler, str(tiny_model_dir),
                                 async_scheduling=True,
                                 num_speculative_tokens=bench.Shape().num_drafts).vllm_config
    made = []
    speculator = bench._speculator
    with pytest.MonkeyPatch.context() as patch, worker_grammar_checks() as checks:
        patch.setattr(bench, "_speculator", lambda *a: made.append(speculator(*a)) or made[-1])
        bench.run_steps(vllm_config, new_grammar, vocab_size, 4, "auto", 40, seed=1)
    choices, grammars = made[0].grammar_choices, made[0].structured.grammars
    assert choices.counts[0] > 0 and choices.num_steps_with_rows > 0  # both ways taken
    assert checks.num_checks["verify"] > 0 and checks.num_checks["draft"] > 0
    assert checks.mismatches == []
    assert grammars.num_known_advances == choices.counts[0] and grammars.num_known_repairs == 0
