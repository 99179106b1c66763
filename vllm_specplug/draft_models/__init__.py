"""Draft-head models: the EAGLE-3 head and the MTP layer as PyTorch modules,
their checkpoints in the layouts vLLM loads, and the parts of the target a
draft reads (embedding, final norm, LM head).

One package used by both sides: `proposers/` runs these modules in the
engine (tree drafting), `training/` trains them. Neither imports the other.
"""
