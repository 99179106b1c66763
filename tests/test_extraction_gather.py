"""The connector's device path: gather a request's rows and write them, on CPU
and (where present, e.g. the lent GPU) CUDA. Imports no vLLM, so it also runs
on machines with only torch."""
import pytest
import torch
from safetensors.torch import load_file

from vllm_specplug.extraction.gather import gather_rows
from vllm_specplug.extraction.storage import TMP_INFIX, save_safetensors_atomic

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 37])
def test_gather_rows_matches_slot_by_slot_copy(device, dtype, num_tokens):
    block_size, num_layers, hidden = 16, 3, 5
    cache = torch.randn(10, num_layers, block_size, hidden).to(device, dtype)
    block_ids = [7, 2, 9]
    expected = torch.stack([cache[block_ids[t // block_size], :, t % block_size]
                            for t in range(num_tokens)])
    rows = gather_rows(cache, block_ids, block_size, num_tokens)
    assert rows.device == cache.device and torch.equal(rows, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_from_the_device_are_written_whole(device, tmp_path):
    cache = torch.randn(4, 2, 16, 8, device=device, dtype=torch.bfloat16)
    rows = gather_rows(cache, [3, 1], 16, 20)
    path = tmp_path / "sub" / "r.safetensors"
    save_safetensors_atomic({"hidden_states": rows.to("cpu"),
                             "token_ids": torch.arange(20)}, path)
    loaded = load_file(str(path))
    assert torch.equal(loaded["hidden_states"], rows.cpu())
    assert not [p for p in path.parent.iterdir() if TMP_INFIX in p.name]
