"""Speculative-decoding counters for tests: the product's `vllm_specplug.metrics`."""
from vllm_specplug.metrics import (SpecDecodeCounts, parse_prometheus_counts,  # noqa: F401
                                   read_spec_decode_counts)
