"""Shared fixtures: the built-in tiny model and one baseline engine per session.

The baseline (no speculation) engine is shared by the whole session and
speculative engines are module-scoped; engine cores run in this process
where they can (docs/testing.md).
"""
from __future__ import annotations

import os
import sys

import pytest

from vllm_specplug.models import build_model, held_out_prompts
from vllm_specplug.testing.engine import (generate, generate_each, greedy_params, make_llm,
                                          shutdown_llm)
from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

# Engine cores in the test process: vLLM's supported in-process mode (the
# same EngineCore, scheduler and runner), 2-3 s an engine instead of 25 on
# this 2-core machine. The session's baseline engine, extraction engines and
# servers keep cores of their own (the plugin must load in the engine
# process, speculative configs must cross to it), and an engine started
# while another runs here gets its own too (`engine.InProcessEngines`).
IN_PROCESS_BY_US = "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

NUM_EVAL_PROMPTS = 24
MAX_NEW_TOKENS = 64
# Prompts run one at a time (the batch runs all 24): a request alone takes
# the single-request paths; more of them cost CI time, not coverage.
NUM_SINGLE_PROMPTS = 8
# sampled tokens compared with no speculation's distribution (plain_samples)
SAMPLE_TEMPERATURE = 1.0


@pytest.fixture(scope="session", autouse=True)
def engines_run_what_cpu_users_run():
    """tests/kernels/conftest.py turns the Triton interpreter on while tests
    are collected (kernels are decorated at import). Engines, servers and
    CLIs that other tests start inherit the environment, and would run our
    kernels interpreted (`backend="auto"`), not the PyTorch paths a CPU user
    runs: one distribution test took 172 s instead of 15. Outside
    tests/kernels the interpreter stays off unless the caller set it."""
    kernels = sys.modules.get("tests.kernels.conftest")  # collected in this session
    if kernels is not None and kernels.SETS_INTERPRETER:
        os.environ.pop("TRITON_INTERPRET", None)
        # Kernels collected with the others (`pytest tests`): vLLM's Triton
        # kernels imported meanwhile are interpreted for good in this
        # process, so engine cores go back to processes of their own
        # (scripts/test.sh runs tests/kernels in a pytest of its own).
        if IN_PROCESS_BY_US:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    yield


@pytest.fixture(autouse=True)
def live_vllm_envs():
    """An engine core caches vLLM's environment variables when it starts
    (`enable_envs_cache`); in the test process that would freeze them for
    every later test. vLLM's own switch undoes it around each test (where
    vLLM is loaded: importing it here would load it under a kernel test's
    Triton interpreter, which its CPU platform breaks)."""
    _clear_vllm_envs_cache()
    yield
    _clear_vllm_envs_cache()


def _clear_vllm_envs_cache() -> None:
    envs = sys.modules.get("vllm.envs")
    if envs is not None:
        envs.disable_envs_cache()


@pytest.fixture(scope="session")
def tiny_model_dir():
    return build_model("tiny")


@pytest.fixture(scope="session")
def tiny_eagle3_dir(tiny_model_dir):
    """The built-in EAGLE-3 head for `tiny` (trained and cached on first use)."""
    from vllm_specplug.models.heads import build_head

    return build_head("tiny-eagle3")


@pytest.fixture(scope="session")
def eval_prompts() -> list[str]:
    return held_out_prompts(NUM_EVAL_PROMPTS)


@pytest.fixture(scope="session")
def baseline_llm(tiny_model_dir):
    # The probe lets tests ask the worker process whether our plugin loaded.
    # Its own process: the plugin must load there, and an engine alive all
    # session in this process would send every other one to its own too.
    llm = make_llm(tiny_model_dir, own_process=True, worker_extension_cls=PROBE_QUALNAME)
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="session")
def baseline_outputs(baseline_llm, eval_prompts):
    """Greedy ids without speculation: per prompt alone, and as one batch."""
    params = greedy_params(MAX_NEW_TOKENS)
    single = generate_each(baseline_llm, eval_prompts[:NUM_SINGLE_PROMPTS], params)
    batched = generate(baseline_llm, eval_prompts, params).token_ids
    return {"single": single, "batched": batched}


@pytest.fixture(scope="session")
def plain_samples(baseline_llm):
    """Sampled tokens per position without speculation, at SAMPLE_TEMPERATURE
    (tests/test_cpu_kernel_fix.py: the distribution check)."""
    from tests.test_cpu_kernel_fix import sample_positions

    return sample_positions(baseline_llm, SAMPLE_TEMPERATURE)


def speculative_engines(configs: dict[str, dict]):
    """A module-scoped fixture running the module's tests once per config."""
    @pytest.fixture(scope="module", params=list(configs))
    def spec_llm(request, tiny_model_dir):
        config = configs[request.param]
        # vLLM's n-gram proposer imports numba: loaded in this process, its
        # llvmlite would send every later engine to a process of its own
        numba = config is not None and config.get("method") == "ngram"
        llm = make_llm(tiny_model_dir, config, own_process=numba,
                       worker_extension_cls=PROBE_QUALNAME)
        yield llm
        shutdown_llm(llm)

    return spec_llm


@pytest.fixture(scope="session")
def tiny_mtp_dir(tiny_model_dir):
    """`tiny` with one trained MTP layer, in MiMo's layout (vLLM's `mtp`)."""
    from vllm_specplug.models.heads import build_head

    return build_head("tiny-mtp")


@pytest.fixture(scope="session")
def smollm2_fp32_dir():
    """SmolLM2-135M-Instruct converted from its GGUF, fp32 weights."""
    from vllm_specplug.models.smollm2 import build_smollm2

    return build_smollm2("float32")


@pytest.fixture(scope="session")
def smollm2_bf16_dir():
    from vllm_specplug.models.smollm2 import build_smollm2

    return build_smollm2("bfloat16")


@pytest.fixture(scope="module")
def smollm2_fp32_llm(smollm2_fp32_dir):
    llm = make_llm(smollm2_fp32_dir, max_model_len=2048)
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="module")
def faulty_entry_point(tmp_path_factory):
    """Register `test_faulty` (tests/proposer_plugins/faulty.py) like a
    third-party package would; engine processes inherit sys.path. Modules
    that use it: `pytestmark = pytest.mark.usefixtures("faulty_entry_point")`."""
    import sys

    from vllm_specplug import registry

    from tests.proposer_plugins.faulty import install_entry_point

    site = str(install_entry_point(tmp_path_factory.mktemp("faulty_site")))
    sys.path.insert(0, site)
    registry.refresh()
    yield
    sys.path.remove(site)
    registry.refresh()
