"""Model Runner V2 (vLLM's CUDA runner): the speculators and the tree step.

- `speculator.py`: model-free proposers (n-gram, suffix, hybrid, third parties).
- `head_speculator.py`: `specplug_eagle3` / `specplug_mtp`, chains and trees,
  drafting on the device from the target's hidden states.
- `tree_slots.py`: the trees of each state slot and the step's verification,
  shared by the speculator, the model state and the sampler.
- `tree_state.py`: the model state that lays a tree step out (positions,
  tree attention rows) and supplies the tree sampler.
- `tree_sampler.py`: greedy and stochastic tree verification, KV compaction.
"""
