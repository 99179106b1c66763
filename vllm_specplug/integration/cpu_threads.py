"""OpenMP thread binding of a sharded target on vLLM's CPU platform.

vLLM's CPU workers bind their OpenMP threads from `VLLM_CPU_OMP_THREADS_BIND`
(`vllm/utils/ompmultiprocessing.py`). Unset, it means "auto": rank r takes
the r-th allowed NUMA node. On a machine with fewer NUMA nodes than ranks
(a laptop, a one-socket server, this project's 2-core CI machine) a
`tensor_parallel_size=2` engine then stops with "Not enough allowed NUMA
nodes to bind threads", which names no setting. Where the variable is unset
we give each rank an equal, contiguous share of the CPUs this process may
use (`"0|1"` on two CPUs), which is what vLLM's own error asks the user to
do by hand. A user's value is kept; one that cannot work gets an error
naming the fix before any process starts.
"""
from __future__ import annotations

ENV = "VLLM_CPU_OMP_THREADS_BIND"
# the value we set last in this process (so that it is ours to change)
OURS = "VLLM_SPECPLUG_OMP_THREADS_BIND"


def per_rank_cpus(allowed_cpus: list[int], num_ranks: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of `num_ranks` ranks an equal,
    contiguous share of `allowed_cpus` (the first ranks take one more when
    they do not divide)."""
    cpus = sorted(allowed_cpus)
    share, extra = divmod(len(cpus), num_ranks)
    lists, start = [], 0
    for rank in range(num_ranks):
        end = start + share + (rank < extra)
        lists.append(",".join(str(c) for c in cpus[start:end]))
        start = end
    return "|".join(lists)


def thread_binding(num_ranks: int, allowed_cpus: list[int], num_numa_nodes: int,
                   current: str | None) -> str | None:
    """The value to set for `VLLM_CPU_OMP_THREADS_BIND` (None: leave it).

    Args:
        num_ranks: CPU workers on this node (tensor x pipeline parallel).
        allowed_cpus: the CPU ids this process may run on.
        num_numa_nodes: the NUMA nodes it may allocate on.
        current: the variable's value, None when unset.
    Raises:
        ValueError: the machine cannot give each rank a CPU, or the value
            asks for NUMA binding the machine cannot do; the message names
            the fix.
    """
    current = (current or "").strip() or None  # empty: unset
    if num_ranks <= 1 or num_numa_nodes >= num_ranks:
        return None
    if current not in (None, "auto"):
        return None  # the user's CPU lists, or "nobind"
    if len(allowed_cpus) < num_ranks:
        raise ValueError(
            f"tensor/pipeline parallel size {num_ranks} on vLLM's CPU platform: this "
            f"process may use {len(allowed_cpus)} CPU(s), one per rank is needed; lower "
            f"tensor_parallel_size, or set {ENV}=nobind to run the ranks unbound")
    suggestion = per_rank_cpus(allowed_cpus, num_ranks)
    if current is not None:
        raise ValueError(
            f"{ENV}=auto binds each of the {num_ranks} ranks to a NUMA node of its own, "
            f"and this machine allows {num_numa_nodes}: unset {ENV} (vllm-specplug then "
            f"splits the CPUs, here {suggestion!r}), or set it to one CPU list per rank, "
            f"e.g. {ENV}={suggestion!r}")
    return suggestion
