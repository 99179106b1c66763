"""Load an EAGLE-3 head directory as vLLM's `eagle3` reads it.

Ours (`vllm-specplug train-eagle3`) carry `specplug_head_config`; published
heads (e.g. the EAGLE-3 authors' LLaMA heads) carry only the HF fields, from
which the same HeadConfig follows. Tensor names are vLLM's llama_eagle3
layout: `fc`, `midlayer.*`, `norm`, `lm_head`, optional `d2t`/`t2d`; an
`embed_tokens.weight` is ignored (the target's embedding is shared).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_specplug.draft_models.eagle3_model import (HEAD_FIX, Eagle3Head, HeadConfig,
                                                 HeadLoadError, load_tensors,
                                                 tensor_problems)

IGNORED_TENSORS = ("embed_tokens.weight", "model.embed_tokens.weight")


def head_config_from_hf(hf: dict) -> HeadConfig:
    """HeadConfig from a head's config.json (ours or a published one)."""
    if "specplug_head_config" in hf:
        return HeadConfig(**hf["specplug_head_config"])
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or (
        hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise KeyError("eagle_aux_hidden_state_layer_ids (give the target layers the "
                       "head was trained on)")
    return HeadConfig(
        hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
        target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"],
        aux_layer_ids=list(aux), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048))


def load_head(head_dir: str | Path) -> Eagle3Head:
    """The head in float32; HeadLoadError names the file and what is wrong."""
    head_dir = Path(head_dir)
    path = head_dir / "config.json"
    try:
        config = head_config_from_hf(json.loads(path.read_text()))
    except FileNotFoundError:
        raise HeadLoadError(f"{path}: missing; {HEAD_FIX}") from None
    except (KeyError, TypeError, ValueError, OSError) as error:
        raise HeadLoadError(f"{path}: not an EAGLE-3 head config ({error})") from error
    head = Eagle3Head(config)
    tensors = load_tensors(head_dir / "model.safetensors", HeadLoadError, HEAD_FIX)
    tensors = {k: v for k, v in tensors.items() if k not in IGNORED_TENSORS}
    for name in ("d2t", "t2d"):  # optional when the draft vocabulary is the target's
        tensors.setdefault(name, head.state_dict()[name])
    tensors = {k: v.to(torch.float32) if v.is_floating_point() else v
               for k, v in tensors.items()}
    problems = tensor_problems(head, tensors)
    if problems:
        raise HeadLoadError(f"{head_dir / 'model.safetensors'}: {'; '.join(problems)}; "
                            f"{HEAD_FIX}")
    head.load_state_dict(tensors)
    return head.eval()


def head_tensor_problems(head_dir: str | Path) -> list[str]:
    """Missing, unexpected or mis-shaped tensors, from the safetensors header
    alone (no tensor is read): the front end's check before an engine starts."""
    from safetensors import safe_open

    head_dir = Path(head_dir)
    config = head_config_from_hf(json.loads((head_dir / "config.json").read_text()))
    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in Eagle3Head(config).state_dict().items()}
    with safe_open(str(head_dir / "model.safetensors"), "pt") as handle:
        found = {k: list(handle.get_slice(k).get_shape()) for k in handle.keys()
                 if k not in IGNORED_TENSORS}
    problems = [f"missing {k}" for k in sorted(set(expected) - set(found))
                if k not in ("d2t", "t2d")]
    problems += [f"unexpected {k}" for k in sorted(set(found) - set(expected))]
    problems += [f"{k} is {found[k]}, expected {shape}" for k, shape in expected.items()
                 if k in found and found[k] != shape]
    return problems
