"""Triton (and Ascend) kernels of vllm-specplug.

Installed as `vllm_specplug.kernels`. `@triton.jit` code lives in this package;
the Python wrappers and plain-PyTorch references live in `vllm_specplug`.
"""
