"""Built-in models, made by our own code from what is on the machine.

No hub access exists on our machines, so every model the tests and benchmarks
use is built here: a byte-level BPE tokenizer trained on the Python standard
library's sources and a small Llama trained on CPU. See `docs/tiny-models.md`.
"""
from vllm_specplug.models.build import MODEL_SPECS, ModelSpec, build_model
from vllm_specplug.models.corpus import held_out_prompts

__all__ = ["MODEL_SPECS", "ModelSpec", "build_model", "held_out_prompts"]
