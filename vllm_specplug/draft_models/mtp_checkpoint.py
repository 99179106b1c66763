"""An MTP-capable model directory: the target plus its MTP layer(s), in the
layout vLLM's `mimo_mtp` serves (`speculative_config={"method": "mtp"}`).

vLLM picks `mimo_mtp` for a target whose `architectures[0]` is
"MiMoForCausalLM" (a Qwen2 model that skips `model.mtp_layers.*` when it
loads) and reads the MTP layers from the same checkpoint. A Qwen2 or MiMo
target is used as it is. A Llama target is written as a Qwen2 one: Qwen2 is
Llama with q/k/v biases, so zero biases give the same function, which the
tests check against transformers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from vllm_specplug.files import save_safetensors_atomic, write_text_atomic

MTP_ARCHITECTURE = "MiMoForCausalLM"
NUM_MTP_LAYERS_KEY = "num_nextn_predict_layers"
LLAMA_ARCHITECTURE = "LlamaForCausalLM"
MTP_TENSOR_MARK = ".mtp_layers."
INDEX_FILE = "model.safetensors.index.json"
ADDED_FILE = "model-specplug-mtp.safetensors"   # next to a sharded target's files
SKIPPED_FILES = {"config.json", INDEX_FILE, "specplug_build.json"}


class MtpTargetError(ValueError):
    """The target cannot carry an MTP layer vLLM serves; names the fix."""


def target_kind(config: dict, target_dir: Path) -> str:
    """'llama' or 'qwen2' (a MiMo target counts as Qwen2)."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch == MTP_ARCHITECTURE or config.get("model_type") == "qwen2":
        return "qwen2"
    if config.get("model_type") == "llama" and arch == LLAMA_ARCHITECTURE:
        return "llama"
    raise MtpTargetError(
        f"--target {target_dir}: architecture {arch!r} (model_type "
        f"{config.get('model_type')!r}); MTP layers are written in MiMo's layout, "
        f"which vLLM serves for Qwen2-style targets: use a Llama, Qwen2 or MiMo target")


def mtp_config(config: dict, kind: str, num_layers: int) -> dict:
    """config.json of the MTP-capable model."""
    out = dict(config)
    out.update({"architectures": [MTP_ARCHITECTURE], "model_type": "qwen2",
                NUM_MTP_LAYERS_KEY: num_layers})
    if kind == "llama":
        out.pop("attention_bias", None)
        out.pop("mlp_bias", None)
        out.setdefault("use_sliding_window", False)
    return out


def zero_qkv_biases(config: dict) -> dict[str, torch.Tensor]:
    """The q/k/v biases that make a Llama checkpoint a Qwen2 one, unchanged."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{layer}.self_attn."
        tensors[prefix + "q_proj.bias"] = torch.zeros(heads * head_dim)
        tensors[prefix + "k_proj.bias"] = torch.zeros(kv_heads * head_dim)
        tensors[prefix + "v_proj.bias"] = torch.zeros(kv_heads * head_dim)
    return tensors


def _target_tensors(target_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if MTP_TENSOR_MARK not in name:      # older MTP layers are replaced
                    tensors[name] = handle.get_tensor(name)
    return tensors


def write_mtp_model(target_dir: str | Path, mtp_tensors: dict[str, torch.Tensor],
                    num_layers: int, out_dir: str | Path) -> Path:
    """Write `out_dir` = the target (every file but its config and weights
    copied) + `mtp_tensors` (checkpoint names), with MiMo's config.

    A single-file target is rewritten as one `model.safetensors`; a sharded
    one keeps its shards and gets the added tensors in ADDED_FILE, listed in
    its index."""
    target_dir, out = Path(target_dir), Path(out_dir)
    config = json.loads((target_dir / "config.json").read_text())
    kind = target_kind(config, target_dir)
    added = dict(mtp_tensors)
    if kind == "llama":
        added.update(zero_qkv_biases(config))
    out.mkdir(parents=True, exist_ok=True)
    for path in target_dir.iterdir():
        if path.is_file() and path.name not in SKIPPED_FILES \
                and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    if (target_dir / INDEX_FILE).is_file():
        _write_sharded(target_dir, out, added)
    else:
        save_safetensors_atomic({**_target_tensors(target_dir), **added},
                                out / "model.safetensors")
    write_text_atomic(json.dumps(mtp_config(config, kind, num_layers), indent=2),
                      out / "config.json")
    return out


def _write_sharded(target_dir: Path, out: Path, added: dict[str, torch.Tensor]) -> None:
    index = json.loads((target_dir / INDEX_FILE).read_text())
    weight_map = {name: shard for name, shard in index["weight_map"].items()
                  if MTP_TENSOR_MARK not in name}
    for shard in sorted(set(weight_map.values())):
        if not (out / shard).exists():
            shutil.copy2(target_dir / shard, out / shard)
    save_safetensors_atomic(added, out / ADDED_FILE)
    weight_map.update({name: ADDED_FILE for name in added})
    write_text_atomic(json.dumps({**index, "weight_map": weight_map}, indent=2),
                      out / INDEX_FILE)


def read_mtp_tensors(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], int]:
    """The MTP layers' tensors of an MTP-capable model and their count."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    num_layers = int(config.get(NUM_MTP_LAYERS_KEY) or 0)
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if MTP_TENSOR_MARK in name:
                    tensors[name] = handle.get_tensor(name)
    return tensors, num_layers
