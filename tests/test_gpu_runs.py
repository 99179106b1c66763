"""The GPU runs' speculative configs, checked here before they cost device
time: `benchmarks/gpu/v2_tree_runs.sh dry-run NAME` prints the arguments its
bench call would pass to `host.sh` (one a line) and runs nothing; every
`--spec` of them must parse as the bench parses it (`bench.specs.parse_spec`:
JSON, a method, our methods' options validated), names unique. A typo in a
hand-written JSON spec there once cost a lease's run at start-up."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vllm_specplug.bench.specs import named_specs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "v2_tree_runs.sh"

# (run name, environment): every bench run of the script and its row sets
RUNS = [
    ("tiny", {}), ("tiny3", {}), ("tiny3", {"ROWS": "compile"}), ("tiny3-schema", {}),
    ("tiny3-schema", {"ROWS": "verify"}),
    ("tiny-mtp", {}), ("tiny-mtp", {"MTP_COMPILE": "1"}), ("tiny-mtp", {"MTP_SIZED": "1"}),
    *[("tiny-batchk", {"BATCHK": rows}) for rows in
      ("heads", "lean", "free", "tree", "zero", "floor", "pin", "shapes")],
    ("smollm2", {}), ("smollm2", {"ROWS": "sized"}), ("smollm2", {"ROWS": "adaptive"}),
    ("smollm2", {"ROWS": "bestk"}), ("smollm2", {"ROWS": "compile"}),
    ("smollm2", {"ROWS": "chains", "NO_PREFIX_CACHE": "1"}),
    ("smollm2", {"ROWS": "chains-lookup"}),
    ("smollm2-sets", {"ROWS": "lookups", "SIZES": "1 16 64", "PHASES": "--phases"}),
    ("smollm2-sets", {"ROWS": "lookups-history", "SIZES": "1 64"}),
    ("smollm2-sets", {"ROWS": "lookups-deep", "SIZES": "1 16 64", "PHASES": "--phases"}),
    ("smollm2-humaneval", {}), ("smollm2-sets", {}), ("smollm2-sets", {"ROWS": "free"}),
    ("smollm2-sets", {"ROWS": "compile", "PHASES": "--phases", "NO_PREFIX_CACHE": "1"}),
    ("smollm2-sets", {"ROWS": "tau-ab"}),
    ("smollm2-sets", {"ROWS": "bestk-wide", "SIZES": "1", "PHASES": "--phases"}),
    ("smollm2-sets", {"ROWS": "bestk-all", "WIDE": "16 4 64", "SIZES": "16 64",
                      "CAPTURE": "4160", "TREE_T": "1.0", "PHASES": "--phases"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "wide-choices", "WIDE": "8 4 32", "TREE_T": "1.0",
                        "SIZES": "16 64", "PHASES": "--phases"}),
    ("smollm2-sets", {"ROWS": "wide", "SIZES": "64", "CAPTURE": "2112"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "wide-choices", "WIDE": "8 4 32", "SIZES": "16"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "wide-choices", "WIDE": "8 4 32", "TREE_T": "1.0",
                        "SIZES": "16", "SCHEMA_SETS": "mt-bench-json", "DTYPE": "float32"}),
    ("smollm2-batchk", {}), ("smollm2-tp", {}),
    ("smollm2-schema", {}), ("smollm2-schema", {"ADAPTIVE": "1"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "first"}), ("smollm2-schema", {"SCHEMA_ROWS": "worker"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "ab"}), ("smollm2-schema", {"SCHEMA_ROWS": "queued"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "depth"}), ("smollm2-schema", {"SCHEMA_ROWS": "lean"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "threads"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "threads-ab", "SIZES": "64"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "tree-rows", "SIZES": "16 64"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "lean-rows"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "choices"}),
    ("smollm2-schema", {"SCHEMA_ROWS": "wide", "WIDE": "8 1 9",
                        "SCHEMA_SETS": "mt-bench-json"}),
]


def _dry_run(name: str, env: dict, tmp_path: Path) -> list[str]:
    """The arguments the run's `host.sh` call would get."""
    done = subprocess.run(
        ["bash", str(SCRIPT), "dry-run", name], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "HOME": str(tmp_path), "OUT": str(tmp_path / "out"), **env},
        timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _engine_args(arguments: list[str]) -> dict:
    """The engine arguments the run passes (one JSON object)."""
    import json

    return json.loads(arguments[arguments.index("--engine-args") + 1])


def _specs(arguments: list[str]) -> list[str]:
    return [arguments[i + 1] for i, argument in enumerate(arguments) if argument == "--spec"]


@pytest.mark.parametrize("name, env", RUNS,
                         ids=[f"{n}{''.join('-' + v.split()[0] for v in e.values())}"
                              for n, e in RUNS])
def test_every_spec_of_a_gpu_run_parses_as_the_bench_reads_it(name, env, tmp_path):
    arguments = _dry_run(name, env, tmp_path)
    assert arguments[0] in ("tiny-bench", "real-bench"), arguments[:3]
    specs = _specs(arguments)
    assert specs, f"{name}: no --spec in {arguments}"
    rows = named_specs(specs)  # raises SpecError naming the bad spec
    assert len(rows) == len(specs) + 1


def test_the_chains_run_holds_the_two_chains_alone(tmp_path):
    """ROWS=chains (issue 26's τ gap): vLLM's eagle3 K=5 and our chain K=5
    beside no speculation, nothing else between their repeats."""
    arguments = _dry_run("smollm2", {"ROWS": "chains"}, tmp_path)
    names = [row.name for row in named_specs(_specs(arguments))]
    assert names == ["none", "vllm-eagle3-K5", "ours-chain-K5"]


def test_the_lookups_run_holds_both_shapes_with_and_without_lookups(tmp_path):
    """ROWS=lookups: vLLM's eagle3 K=5, our chain K=5 with prompt lookups and
    tree 16 without and with them (SmolLM2's trees at draft temperature 1.0)."""
    arguments = _dry_run("smollm2-sets", {"ROWS": "lookups"}, tmp_path)
    rows = {row.name: row for row in named_specs(_specs(arguments))}
    assert list(rows) == ["none", "vllm-eagle3-K5", "ours-chain-K5-lookup", "ours-tree16",
                          "ours-tree16-lookup"]
    looked_up = [name for name, row in rows.items()
                 if (row.config or {}).get("prompt_lookup_min") == 3]
    assert looked_up == ["ours-chain-K5-lookup", "ours-tree16-lookup"]
    assert rows["ours-tree16-lookup"].config["draft_temperature"] == 1.0


def test_the_deep_lookups_run_holds_tree_16_three_ways(tmp_path):
    """ROWS=lookups-deep: tree 16 without lookups, with them and with
    12-token lookups (a branch below its 4 levels)."""
    arguments = _dry_run("smollm2-sets", {"ROWS": "lookups-deep"}, tmp_path)
    rows = {row.name: row.config for row in named_specs(_specs(arguments))}
    assert list(rows) == ["none", "vllm-eagle3-K5", "ours-tree16", "ours-tree16-lookup",
                          "ours-tree16-lookup-L12"]
    assert rows["ours-tree16-lookup-L12"] == {**rows["ours-tree16-lookup"],
                                              "prompt_lookup_tokens": 12}
    assert rows["ours-tree16-lookup"] == {**rows["ours-tree16"], "prompt_lookup_min": 3}


def test_the_lookups_history_run_keeps_one_tree_two_ways(tmp_path):
    """ROWS=lookups-history: tree 16 with lookups, its histories in GPU
    memory (the default) and through UVA (token_history "host")."""
    arguments = _dry_run("smollm2-sets", {"ROWS": "lookups-history"}, tmp_path)
    rows = {row.name: row.config for row in named_specs(_specs(arguments))}
    assert list(rows) == ["none", "vllm-eagle3-K5", "ours-tree16-lookup",
                          "ours-tree16-lookup-uva"]
    assert "token_history" not in rows["ours-tree16-lookup"]
    assert rows["ours-tree16-lookup-uva"] == {**rows["ours-tree16-lookup"],
                                              "token_history": "host"}


def test_the_wide_schema_run_names_its_shape_and_reads_the_schema_set_alone(tmp_path):
    arguments = _dry_run("smollm2-schema", {"SCHEMA_ROWS": "wide", "WIDE": "8 1 9",
                                            "SCHEMA_SETS": "mt-bench-json"}, tmp_path)
    names = [row.name for row in named_specs(_specs(arguments))]
    assert names == ["none", "ours-chain-K5-first", "ours-tree-8-1-9-first"]
    sets = [arguments[i + 1] for i, a in enumerate(arguments) if a == "--prompts"]
    assert sets == ["mt-bench-json"]
    config = named_specs(_specs(arguments))[2].config
    assert (config["topk"], config["num_steps"], config["num_draft_tokens"]) == (8, 1, 9)
    assert config["grammar_drafts"] == "first"


def test_the_tiny_verify_run_holds_tree_16_two_ways_under_the_schema(tmp_path):
    arguments = _dry_run("tiny3-schema", {"ROWS": "verify"}, tmp_path)
    rows = named_specs(_specs(arguments))
    assert [row.name for row in rows] == ["none", "vllm-eagle3-K5", "ours-tree16",
                                          "ours-tree16-choices"]
    assert "--json-schema" in arguments


@pytest.mark.parametrize("name", ["tiny3", "tiny-mtp", "smollm2", "smollm2-sets",
                                  "smollm2-schema"])
def test_the_runs_start_their_engines_at_once_unless_told_not_to(name, tmp_path):
    """By default the run starts its engines at once (bench/starts.py sizes
    each KV cache); PARALLEL_KV sets that size in engine arguments that are
    still one JSON object; with PARALLEL empty, one after the other."""
    for env, parallel, size in (({}, True, None), ({"PARALLEL_KV": "4000000000"}, True, 4e9),
                                ({"PARALLEL": ""}, False, None)):
        arguments = _dry_run(name, env, tmp_path)
        engine_kwargs = _engine_args(arguments)
        assert ("--parallel-starts" in arguments) == parallel, env
        assert engine_kwargs.get("kv_cache_memory_bytes") == size, env


def test_the_sets_run_takes_fewer_sizes_and_a_bigger_capture(tmp_path):
    """SIZES and CAPTURE (a 33-token tree at batch 64 is 2112 tokens a step:
    over the default 1024 it ran without graphs on the H200)."""
    arguments = _dry_run("smollm2-sets", {"ROWS": "wide", "SIZES": "64", "CAPTURE": "2112"},
                         tmp_path)
    sizes = arguments[arguments.index("--batch-sizes") + 1:arguments.index("--limit-prompts")]
    assert sizes == ["64"]
    engine_kwargs = _engine_args(arguments)
    assert engine_kwargs["compilation_config"]["max_cudagraph_capture_size"] == 2112
    names = [row.name for row in named_specs(_specs(arguments))]
    assert names == ["none", "vllm-eagle3-K5", "ours-tree16", "ours-tree-8-4-32"]


def test_the_schema_run_takes_a_bigger_capture_too(tmp_path):
    """CAPTURE reaches the schema run's engines: the seventieth session's
    8-4-32 tree at batch 64 (2048 tokens a step) ran without graphs there
    under the script's fixed 1024, on both prompt sets."""
    arguments = _dry_run("smollm2-schema", {"SCHEMA_ROWS": "wide-choices", "WIDE": "8 4 32",
                                            "SIZES": "64", "CAPTURE": "2112"}, tmp_path)
    engine_kwargs = _engine_args(arguments)
    assert engine_kwargs["compilation_config"]["max_cudagraph_capture_size"] == 2112
    default = _dry_run("smollm2-schema", {"SCHEMA_ROWS": "wide-choices"}, tmp_path)
    engine_kwargs = _engine_args(default)
    assert engine_kwargs["compilation_config"]["max_cudagraph_capture_size"] == 1024


@pytest.mark.parametrize("name", ["smollm2", "smollm2-sets"])
def test_the_smollm2_runs_turn_prefix_caching_off_when_told(name, tmp_path):
    """NO_PREFIX_CACHE=1: every engine without prefix caching (whether our
    head's saved prefix rows explain a τ gap to vLLM's `eagle3`), the
    engine arguments still one JSON object; unset, vLLM's default."""
    for env, want in (({}, None), ({"NO_PREFIX_CACHE": "1"}, False)):
        arguments = _dry_run(name, env, tmp_path)
        engine_kwargs = _engine_args(arguments)
        assert engine_kwargs.get("enable_prefix_caching") == want, env


@pytest.mark.parametrize("name", ["smollm2-sets", "smollm2-schema"])
def test_the_smollm2_runs_pass_a_float32_dtype_when_told(name, tmp_path):
    """DTYPE=float32: the bench compares outputs token for token (a bf16
    difference under a schema at a 1.75-nat gap, 2026-12-06, needs that
    check); unset, the model's own dtype (no --dtype)."""
    for env, want in (({}, None), ({"DTYPE": "float32"}, "float32")):
        arguments = _dry_run(name, env, tmp_path)
        got = arguments[arguments.index("--dtype") + 1] if "--dtype" in arguments else None
        assert got == want, env
