"""Thread binding of a sharded target on vLLM's CPU platform
(`integration/cpu_threads.py`), and the config hook that applies it to a real
VllmConfig built by vLLM's EngineArgs (no engine)."""
from __future__ import annotations

import os

import pytest

from vllm_specplug.integration.cpu_threads import ENV, per_rank_cpus, thread_binding


def test_cpus_are_split_evenly_and_contiguously():
    assert per_rank_cpus([0, 1], 2) == "0|1"
    assert per_rank_cpus([3, 1, 2, 0], 2) == "0,1|2,3"
    assert per_rank_cpus(list(range(5)), 2) == "0,1,2|3,4"
    assert per_rank_cpus([4, 5, 6, 7], 4) == "4|5|6|7"


def test_binding_is_chosen_only_where_vllm_would_refuse():
    assert thread_binding(1, [0, 1], 1, None) is None       # one rank
    assert thread_binding(2, [0, 1, 2, 3], 2, None) is None  # a NUMA node per rank
    assert thread_binding(2, [0, 1], 1, "nobind") is None    # the user's choice
    assert thread_binding(2, [0, 1], 1, "0|1") is None
    assert thread_binding(2, [0, 1], 1, None) == "0|1"
    assert thread_binding(2, [0, 1, 2, 3], 1, "") == "0,1|2,3"


def test_bindings_that_cannot_work_name_the_fix():
    with pytest.raises(ValueError, match="one per rank is needed.*tensor_parallel_size.*nobind"):
        thread_binding(4, [0, 1], 1, None)
    with pytest.raises(ValueError, match=f"{ENV}=auto .* unset {ENV}.*'0\\|1'"):
        thread_binding(2, [0, 1], 1, "auto")


def test_a_sharded_config_on_one_numa_node_gets_a_binding(tiny_model_dir, monkeypatch):
    """What `LLM(tensor_parallel_size=2)` builds first: the plugin's config
    hook sets the binding before any worker starts, and leaves a user's own
    value alone. The machine is made one NUMA node with CPUs 0-3, as the CI
    machine is one node (with 2 CPUs)."""
    import vllm.utils.cpu_resource_utils as cpu_resources
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(cpu_resources, "get_visible_memory_node", lambda: [0])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv(ENV, raising=False)
    EngineArgs(model=str(tiny_model_dir), tensor_parallel_size=2,
               max_model_len=256).create_engine_config()
    assert os.environ[ENV] == "0,1|2,3"
    monkeypatch.setenv(ENV, "nobind")
    EngineArgs(model=str(tiny_model_dir), tensor_parallel_size=2,
               max_model_len=256).create_engine_config()
    assert os.environ[ENV] == "nobind"
    monkeypatch.setenv(ENV, "auto")
    with pytest.raises(ValueError, match="unset VLLM_CPU_OMP_THREADS_BIND"):
        EngineArgs(model=str(tiny_model_dir), tensor_parallel_size=2,
                   max_model_len=256).create_engine_config()
