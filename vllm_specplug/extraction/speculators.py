"""Export a dataset to one file per sample, the layout `speculators` trains on.

`OUT/data_config.json` (layer ids, hidden size, dtype, model) and
`OUT/data_{i}.safetensors` per sample with `token_ids` [T] int64,
`hidden_states` [T, L, H] (layers in `layer_ids` order) and `loss_mask` [T]
uint8. safetensors, not `torch.save`: no pickle on the way.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from vllm_specplug.extraction.dataset import HiddenStatesDataset
from vllm_specplug.extraction.storage import save_safetensors_atomic, write_json_atomic


def export_speculators(data_dir: str, out_dir: str) -> int:
    dataset = HiddenStatesDataset(data_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**asdict(dataset.info), "num_samples": len(dataset),
              "sample_ids": [r.sample_id for r in dataset.records]}
    for index in tqdm(range(len(dataset)), desc="export", unit="sample"):
        item = dataset[index]
        save_safetensors_atomic(
            {"token_ids": item["input_ids"], "hidden_states": item["hidden_states"],
             "loss_mask": item["loss_mask"]},
            out / f"data_{index}.safetensors",
            metadata={"sample_id": item["sample_id"]})
    write_json_atomic(config, out / "data_config.json")
    return len(dataset)
