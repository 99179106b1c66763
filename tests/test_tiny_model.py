"""The built-in tiny model: format, quality, determinism, and vLLM loading it
the same way transformers does."""
from __future__ import annotations

import dataclasses
import json
import string

import pytest
import torch
from safetensors.torch import load_file

from vllm_specplug.models import MODEL_SPECS, build_model
from vllm_specplug.models.build import read_build_info
from vllm_specplug.models.corpus import load_corpus
from vllm_specplug.testing.engine import generate, greedy_params

PYTHON_MARKERS = ("return", "self", "=", "(", "if ", "for ", "def ", "import")
# A throwaway spec: determinism is a property of the recipe, not of its size.
MICRO = dataclasses.replace(MODEL_SPECS["tiny"], name="micro", vocab_size=512,
                            hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=64, seq_len=64, batch_size=4,
                            num_steps=3, warmup_steps=1, num_eval_windows=2)


def test_hf_layout_and_size(tiny_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json"):
        assert (tiny_model_dir / name).is_file(), name
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] >= 6  # EAGLE-3 needs distinct aux layers


def test_held_out_loss_beats_unigram_by_a_margin(tiny_model_dir):
    info = read_build_info(tiny_model_dir)
    assert info["held_out_loss"] < info["unigram_held_out_loss"] - 1.5, info


def test_second_build_is_a_cache_hit(tiny_model_dir):
    stamp = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_model("tiny") == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_build_is_deterministic(tmp_path):
    first = build_model(MICRO, cache_dir=tmp_path / "a", progress=False)
    second = build_model(MICRO, cache_dir=tmp_path / "b", progress=False)
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()


def test_tokenizer_round_trips_held_out_code(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in load_corpus().held_out[:3]:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "def f():"}], tokenize=False,
        add_generation_prompt=True)
    assert text == "<|bos|><|user|>\ndef f():<|end|>\n<|assistant|>\n"


def test_vllm_prompt_logprobs_match_transformers(tiny_model_dir, baseline_llm,
                                                 eval_prompts):
    """vLLM must load our checkpoint exactly as transformers does."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = eval_prompts[0]
    out = baseline_llm.generate([prompt], greedy_params(1, prompt_logprobs=0),
                                use_tqdm=False)[0]
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        hf_logprobs = hf(ids).logits[0].log_softmax(-1)
    ours = torch.tensor([out.prompt_logprobs[i][ids[0, i].item()].logprob
                         for i in range(1, ids.shape[1])])
    theirs = hf_logprobs[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)


def test_greedy_text_is_code_like(baseline_llm, eval_prompts):
    texts = generate(baseline_llm, eval_prompts, greedy_params(48)).texts
    printable = set(string.printable)
    for text in texts:
        assert sum(c in printable for c in text) >= 0.95 * len(text), repr(text)
    with_markers = [t for t in texts if sum(m in t for m in PYTHON_MARKERS) >= 2]
    assert len(with_markers) >= 0.8 * len(texts), texts
    distinct_lines = {line.strip() for t in texts for line in t.splitlines()}
    assert len(distinct_lines) >= len(texts), "outputs collapse to a few lines"


def test_unknown_model_name_lists_choices():
    with pytest.raises(ValueError, match=r"unknown built-in model 'huge'.*'small', 'tiny'"):
        build_model("huge")


def test_held_out_prompts_are_distinct_and_unseen():
    from vllm_specplug.models import held_out_prompts

    prompts = held_out_prompts(24)
    assert len(set(prompts)) == 24
    train_text = "\n".join(load_corpus().train)
    assert sum(p in train_text for p in prompts) <= 2  # boilerplate may recur
