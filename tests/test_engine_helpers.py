"""`vllm_specplug.engine`: engines whose core runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which tests/conftest.py sets) share
vLLM's process-wide state; `InProcessEngines` keeps one at a time here and
gives the others processes of their own (real engines, the tiny model)."""
from __future__ import annotations

import os

from vllm_specplug.bench.worker_info import WORKER_INFO_QUALNAME
from vllm_specplug.engine import IN_PROCESS, generate, greedy_params, make_llm, shutdown_llm
from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

PROMPT = ["def add(a, b):"]


def _pid(llm) -> int:
    return llm.collective_rpc("specplug_registration_state")[0]["pid"]


def test_one_engine_core_at_a_time_runs_here_and_others_get_their_own(tiny_model_dir):
    """The first engine's core runs in this process; a second, started while
    it runs, gets its own (in-process, its shutdown would destroy vLLM's
    distributed groups under the first). The first still generates after
    the second stops. Stopped, the first takes its worker extension back
    out of vLLM's worker class, so the next engine here may bring another
    (vLLM refuses a second extension with the same calls)."""
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    first = make_llm(tiny_model_dir, worker_extension_cls=PROBE_QUALNAME)
    try:
        assert first in IN_PROCESS.live and _pid(first) == os.getpid()
        before = generate(first, PROMPT, greedy_params(8)).token_ids
        second = make_llm(tiny_model_dir, worker_extension_cls=PROBE_QUALNAME)
        try:
            assert second not in IN_PROCESS.live and _pid(second) != os.getpid()
        finally:
            shutdown_llm(second)
        assert generate(first, PROMPT, greedy_params(8)).token_ids == before
    finally:
        shutdown_llm(first)
    third = make_llm(tiny_model_dir, worker_extension_cls=WORKER_INFO_QUALNAME)
    try:
        assert third in IN_PROCESS.live
        assert third.collective_rpc("specplug_runner_state")[0]["runner"]
    finally:
        shutdown_llm(third)
    assert not IN_PROCESS.live
