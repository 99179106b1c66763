"""Independent reference: hidden states from a Hugging Face transformers forward."""
from __future__ import annotations

import torch


def load_hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_hidden_states(model, input_ids: list[int] | torch.Tensor,
                     layer_ids: list[int]) -> torch.Tensor:
    """[T, L, H]: layer id l < n is `output_hidden_states[l]` (the residual
    stream entering decoder layer l); l == n is the last decoder layer's output
    before the final norm (HF's `hidden_states[n]` has the norm applied)."""
    layers = model.model.layers
    captured = {}

    def keep_output(module, args, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = layers[-1].register_forward_hook(keep_output)
    try:
        ids = torch.as_tensor(input_ids, dtype=torch.long)[None]
        out = model(ids, output_hidden_states=True)
    finally:
        handle.remove()
    rows = [captured["last"][0] if l == len(layers) else out.hidden_states[l][0]
            for l in layer_ids]
    return torch.stack(rows, dim=1)
