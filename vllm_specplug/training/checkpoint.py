"""Training checkpoints without pickle: safetensors for tensors, JSON for the rest.

    OUT/checkpoints/step-00000100/{model.safetensors, optimizer.safetensors, state.json}
    OUT/checkpoints/latest.json   {"step": 100}   written last, atomically

A run killed while writing leaves `latest.json` pointing at the previous
complete checkpoint.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_specplug.extraction.storage import save_safetensors_atomic, write_json_atomic

KEEP = 2


def _step_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / f"step-{step:08d}"


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """AdamW-style state as flat tensors plus JSON-able param groups."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().clone().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def restore_optimizer(optimizer, tensors: dict, meta: dict) -> None:
    state: dict = {}
    for name, value in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    for name, value in meta["scalars"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(root: str | Path, step: int, head, optimizer, trainer_state: dict) -> None:
    root = Path(root)
    directory = _step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(head.state_dict(), directory / "model.safetensors")
    tensors, meta = optimizer_tensors(optimizer)
    save_safetensors_atomic(tensors, directory / "optimizer.safetensors")
    write_json_atomic({**trainer_state, "optimizer": meta}, directory / "state.json")
    write_json_atomic({"step": step}, root / "checkpoints" / "latest.json")
    for old in sorted((root / "checkpoints").glob("step-*"))[:-KEEP]:
        shutil.rmtree(old)


def load_latest(root: str | Path, head, optimizer) -> dict | None:
    """Restore head and optimizer in place; the trainer state, or None."""
    pointer = Path(root) / "checkpoints" / "latest.json"
    if not pointer.exists():
        return None
    directory = _step_dir(Path(root), json.loads(pointer.read_text())["step"])
    head.load_state_dict(load_file(str(directory / "model.safetensors")))
    state = json.loads((directory / "state.json").read_text())
    restore_optimizer(optimizer, load_file(str(directory / "optimizer.safetensors")),
                      state.pop("optimizer"))
    return state
