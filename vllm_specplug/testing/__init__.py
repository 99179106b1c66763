"""Helpers that drive a real vLLM engine on the built-in models.

Used by the test suite, the benchmarks and `vllm-specplug demo`. Nothing here
mocks vLLM: every helper takes a real `vllm.LLM`.
"""
