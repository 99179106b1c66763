"""benchmarks/offline_head_acceptance.py: our head's chain drafting against
the target's greedy continuations, without an engine (the built-in model
and its head, on CPU). The drafts a step are what acceptance counts mean
(never more at a later position than an earlier one), the built-in head
accepts what it accepts in engines, and bad variants are refused naming
the part."""
from __future__ import annotations

import json

import pytest

from tests.scripts import benchmark_script


def _script():
    return benchmark_script("offline_head_acceptance")


def test_offline_acceptance_of_the_builtin_head(tiny_model_dir, tiny_eagle3_dir, tmp_path,
                                                capsys):
    script = _script()
    out = tmp_path / "acceptance.json"
    assert script.main(["--target", str(tiny_model_dir), "--head", str(tiny_eagle3_dir),
                        "--prompts", "held-out", "--num-prompts", "3", "--max-tokens", "32",
                        "--variants", "fp32", "bf16-torch", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fp32", "bf16-torch"]
    for row in rows:
        positions = row["per_position"]
        assert len(positions) == 5 and row["num_steps"] == 3 * (32 - 5)
        assert all(a >= b for a, b in zip(positions, positions[1:])), positions
        assert row["tau"] == pytest.approx(1 + sum(positions))
        # the built-in head drafts well on its own model's text (τ 3.2-3.9 in
        # engines on held-out prompts: docs/results/v2_tiny3_aa_h200)
        assert row["tau"] > 2.5, row
    assert "fp32" in capsys.readouterr().out


def test_drafting_through_the_v2_speculator_beside_the_reference(tiny_model_dir,
                                                                 tiny_eagle3_dir, tmp_path):
    """`--speculator`: the chain through the Model Runner V2 speculator at the
    engine's steps, and the plain runtime fed the same positions: on CPU in
    float32 the same drafts, step for step (the prompts served one at a
    time, `--speculator-batch 1`: batch 1, as the engine's at batch 1)."""
    script = _script()
    out = tmp_path / "speculator.json"
    assert script.main(["--target", str(tiny_model_dir), "--head", str(tiny_eagle3_dir),
                        "--prompts", "held-out", "--num-prompts", "2", "--max-tokens", "32",
                        "--variants", "--speculator", '{"topk": 1, "num_steps": 5}',
                        "--speculator-dtype", "fp32", "--speculator-batch", "1",
                        "--out", str(out)]) == 0
    speculator, reference = json.loads(out.read_text())["rows"]
    assert speculator["variant"].startswith("speculator") and speculator["num_steps"] > 0
    assert speculator["per_position"] == reference["per_position"]
    assert speculator["num_differing"] == 0
    with pytest.raises(SystemExit):
        script.main(["--target", "t", "--head", "h", "--speculator", "[1]"])


@pytest.mark.parametrize("text, message", [
    ("fp16", "starts with a dtype, one of bf16, fp32"),
    ("bf16-fast", "'compiled' and at most one of torch, triton"),
    ("bf16-torch-triton", "at most one of torch, triton"),
])
def test_bad_variants_are_named(text, message):
    with pytest.raises(ValueError, match=message) as error:
        _script().parse_variant(text)
    assert f"--variants {text}" in str(error.value)


def test_a_variant_names_dtype_compile_and_backend():
    import torch

    variant = _script().parse_variant("bf16-compiled-triton")
    assert (variant.dtype, variant.compiled, variant.backend) == (torch.bfloat16, True,
                                                                  "triton")
    assert _script().parse_variant("fp32").backend == "auto"
