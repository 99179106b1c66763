"""vLLM's V1 model runner (the CPU platform, and CUDA with
`VLLM_USE_V2_MODEL_RUNNER=0`): the drafters vLLM builds through
`custom_class` and the tree step on the host.

- `drafter.py`: model-free proposers (over `integration/session.py`).
- `tree_drafter.py`: `specplug_eagle3` / `specplug_mtp` (over
  `integration/head_drafter.py`); `prefix_rows.py`: their head's rows of
  prefix-cache hits.
- `tree_step.py`, `cpu_tree_attention.py`, `cpu_kv_layout.py`, `tree_sampler.py`:
  a tree step's layout, attention rows, cache layout, verification.
- `kernel_overrides.py`: the CPU platform's rejection-sampler kernel fix.
- `tree_profile.py`: per-phase times of tree steps (benchmarks).
"""
