"""`vllm-specplug bench`: offline engines and online servers side by side,
with tables, JSON and plots."""
