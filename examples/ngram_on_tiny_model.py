"""Generate with vLLM's built-in n-gram speculation on the built-in tiny model.

    .venv/bin/python examples/ngram_on_tiny_model.py
"""
from vllm import LLM, SamplingParams

from vllm_specplug.models import build_model

if __name__ == "__main__":  # vLLM starts processes
    model_dir = build_model("tiny")  # trained on CPU the first time, then cached
    llm = LLM(model=str(model_dir), enforce_eager=True, max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 4})
    prompt = "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64))
    print(prompt + out[0].outputs[0].text)
