"""vllm-specplug: an out-of-tree speculative-decoding plugin for vLLM.

Importing this package is cheap and imports nothing from vLLM: vLLM loads our
`register()` entry point in every process it starts.
"""
__version__ = "0.1.0"
