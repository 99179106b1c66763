"""Training checkpoints without pickle: safetensors for tensors, JSON for the rest.

    OUT/checkpoints/step-00000100/{model.safetensors, optimizer.safetensors, state.json}
    OUT/checkpoints/latest.json   {"step": 100}   written last, atomically

A run killed while writing leaves `latest.json` pointing at the previous
complete checkpoint; a write that fails (disk full) removes the unfinished
step directory and raises OutputWriteError, leaving the same. Resuming checks
every tensor name and shape before loading: CheckpointError names the file,
what is wrong and what to do. When the step `latest.json` names has no
directory (deleted by hand), the newest complete earlier one is used.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from vllm_specplug.files import OutputWriteError
from vllm_specplug.files import save_safetensors_atomic, write_json_atomic
from vllm_specplug.draft_models.eagle3_model import load_tensors, tensor_problems

KEEP = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from."""


def _step_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / f"step-{step:08d}"


def _complete_steps(root: Path) -> list[int]:
    """Steps whose directory holds state.json (written after the tensors)."""
    return sorted(int(d.name[5:]) for d in (root / "checkpoints").glob("step-*")
                  if d.name[5:].isdigit() and (d / "state.json").exists())


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
    try:
        save_safetensors_atomic(head.state_dict(), directory / "model.safetensors")
        tensors, meta = optimizer_tensors(optimizer)
        save_safetensors_atomic(tensors, directory / "optimizer.safetensors")
        write_json_atomic({**trainer_state, "optimizer": meta}, directory / "state.json")
        write_json_atomic({"step": step}, root / "checkpoints" / "latest.json")
    except OSError as error:
        # latest.json still names the previous checkpoint: drop the unfinished one.
        if _pointer_step(root) != step:
            shutil.rmtree(directory, ignore_errors=True)
        raise OutputWriteError.wrap(error, directory) from error
    for old in sorted((root / "checkpoints").glob("step-*"))[:-KEEP]:
        shutil.rmtree(old)


def _pointer_step(root: Path) -> int | None:
    try:
        return int(json.loads((root / "checkpoints" / "latest.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_step(root: str | Path) -> int | None:
    """The step `latest.json` names, or None."""
    return _pointer_step(Path(root))


def load_latest(root: str | Path, head, optimizer) -> dict | None:
    """Restore head and optimizer in place; the trainer state, or None."""
    root = Path(root)
    pointer = root / "checkpoints" / "latest.json"
    if not pointer.exists():
        return None
    step = _pointer_step(root)
    if step is None:
        raise CheckpointError(f"{pointer}: unreadable ({pointer.read_bytes()[:80]!r}); "
                              f"{_fix(root, None)}")
    if not _step_dir(root, step).is_dir():          # deleted by hand
        older = [s for s in _complete_steps(root) if s < step]
        if not older:
            raise CheckpointError(f"{_step_dir(root, step)}: missing, and no earlier "
                                  f"checkpoint is complete; {_fix(root, None)}")
        step = older[-1]
    directory, fix = _step_dir(root, step), _fix(root, step)
    model = load_tensors(directory / "model.safetensors", CheckpointError, fix)
    _check(directory / "model.safetensors", tensor_problems(head, model), fix)
    state = _read_state(directory, fix)
    moments = load_tensors(directory / "optimizer.safetensors", CheckpointError, fix)
    _check(directory / "optimizer.safetensors", _optimizer_problems(optimizer, moments),
           fix)
    head.load_state_dict(model)
    try:
        restore_optimizer(optimizer, moments, state.pop("optimizer"))
    except (KeyError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{directory / 'state.json'}: optimizer state unusable "
                              f"({error}); {fix}") from error
    return state


def _read_state(directory: Path, fix: str) -> dict:
    path = directory / "state.json"
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not {"step", "optimizer"} <= set(state):
            raise ValueError("no step or optimizer field")
        return state
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error}); {fix}") from error


def _optimizer_problems(optimizer, tensors: dict) -> list[str]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wrong = []
    for name, value in tensors.items():
        index, _, key = name.partition(".")
        if not index.isdigit() or int(index) >= len(params):
            wrong.append(f"{name} (no parameter {index})")
        elif key.startswith("exp_avg") and value.shape != params[int(index)].shape:
            wrong.append(f"{name} {list(value.shape)} (expected "
                         f"{list(params[int(index)].shape)})")
    return [f"mis-shaped or unexpected tensors: {', '.join(wrong)}"] if wrong else []


def _check(path: Path, problems: list[str], fix: str) -> None:
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)}; {fix}")


def _fix(root: Path, step: int | None) -> str:
    """What to do about a damaged checkpoint `step`."""
    earlier = [s for s in _complete_steps(root) if step is not None and s < step]
    back = (f"delete {_step_dir(root, step)} to resume from step {earlier[-1]} (the "
            "previous checkpoint), or " if earlier else "")
    return ("checkpoints are written atomically, so this one was changed afterwards "
            "or comes from a run with other --data, --target or --draft-vocab-size: "
            f"{back}pass --no-resume to start over")
