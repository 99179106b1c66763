"""The MTP layer and its checkpoint, without an engine: the block against
transformers' Qwen2 decoder layer, the TTT unroll against token-by-token
drafting, the Llama -> MiMo conversion against the target it came from,
training and resumption."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.test_training_unit import synthetic_dataset
from vllm_specplug.draft_models.layers import rope_cos_sin
from vllm_specplug.draft_models.mtp_checkpoint import (MtpTargetError, read_mtp_tensors,
                                                   write_mtp_model)
from vllm_specplug.draft_models.mtp_model import MtpConfig, MtpLayer
from vllm_specplug.training.mtp_trainer import MtpTrainer
from vllm_specplug.training.trainer import TrainConfig, run_training

CONFIG = MtpConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=100, rms_norm_eps=1e-6,
                   rope_theta=10000.0)


def random_layer(seed: int) -> MtpLayer:
    layer = MtpLayer(CONFIG)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():       # biases and norms too: nothing trivial
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3
                        + (1.0 if param.dim() == 1 else 0.0))
    return layer


def qwen2_reference(layer: MtpLayer, hidden, embeds, positions):
    """Step 0 through transformers' Qwen2DecoderLayer with the layer's weights."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    config = Qwen2Config(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=100,
                         rms_norm_eps=1e-6, attn_implementation="eager")
    block = Qwen2DecoderLayer(config, layer_idx=0).eval()
    names = {k: v for k, v in layer.state_dict().items()
             if k.startswith(("self_attn.", "mlp.", "input_layernorm.",
                              "post_attention_layernorm."))}
    block.load_state_dict(names)
    embeds = torch.where((positions == 0)[None, :, None], 0.0, embeds)
    u = layer.input_proj(torch.cat([layer.hidden_layernorm(hidden),
                                    layer.token_layernorm(embeds)], dim=-1))
    T = positions.numel()
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    cos, sin = rope_cos_sin(positions, layer.inv_freq)
    out = block(u, attention_mask=mask, position_embeddings=(cos[None], sin[None]))
    out = out[0] if isinstance(out, tuple) else out
    return layer.final_layernorm(out)


def test_step_zero_is_a_qwen2_decoder_layer():
    layer = random_layer(0)
    gen = torch.Generator().manual_seed(1)     # fixed inputs: no test depends on luck
    hidden, embeds = torch.randn(1, 9, 32, generator=gen), torch.randn(1, 9, 32, generator=gen)
    positions = torch.arange(9)
    with torch.no_grad():
        ours = layer(hidden, embeds, positions, torch.ones(1, 9, dtype=torch.bool), 1)[0]
        torch.testing.assert_close(ours, qwen2_reference(layer, hidden, embeds, positions),
                                   atol=1e-5, rtol=1e-5)


def chain_outputs(layer: MtpLayer, hidden, embeds, anchor: int, num_steps: int):
    """vLLM's drafting, one token at a time: the draft's KV cache holds step-0
    keys up to the anchor; each later step feeds the layer its own output at
    the next position and appends its key."""
    T = embeds.shape[1]
    positions = torch.arange(T)
    embeds = torch.where((positions == 0)[None, :, None], 0.0, embeds)
    cos, sin = rope_cos_sin(positions, layer.inv_freq)
    attn = layer.self_attn

    def qkv(h, e, p):
        x = layer.input_layernorm(layer.input_proj(torch.cat(
            [layer.hidden_layernorm(h), layer.token_layernorm(e)], dim=-1)))
        from vllm_specplug.draft_models.layers import split_heads
        return split_heads(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), 4, 2, 8,
                           cos[p], sin[p])

    _, k0, v0 = qkv(hidden, embeds, slice(0, T))
    keys, values = [k0[:, :, :anchor + 1]], [v0[:, :, :anchor + 1]]
    h, outputs = hidden[:, anchor:anchor + 1], []
    for step in range(num_steps):
        p = anchor + step
        u = layer.input_proj(torch.cat([layer.hidden_layernorm(h),
                                        layer.token_layernorm(embeds[:, p:p + 1])], dim=-1))
        q, k, v = qkv(h, embeds[:, p:p + 1], slice(p, p + 1))
        if step > 0:
            keys.append(k)
            values.append(v)
        kk, vv = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        probs = torch.softmax(q @ kk.transpose(-1, -2) * 8 ** -0.5, dim=-1)
        residual = attn.o_proj((probs @ vv).transpose(1, 2).reshape(1, 1, -1)) + u
        h = layer.final_layernorm(layer.mlp(layer.post_attention_layernorm(residual))
                                  + residual)
        outputs.append(h[0, 0])
    return outputs


@pytest.mark.parametrize("num_tokens,num_steps", [(9, 3), (13, 4), (5, 1)])
def test_ttt_unroll_equals_token_by_token_drafting(num_tokens, num_steps):
    layer = random_layer(num_tokens)
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(1, num_tokens, 32, generator=gen)
    embeds = torch.randn(1, num_tokens, 32, generator=gen)
    with torch.no_grad():
        ttt = layer(hidden, embeds, torch.arange(num_tokens),
                    torch.ones(1, num_tokens, dtype=torch.bool), num_steps)
        for anchor in range(num_tokens - num_steps + 1):
            for step, expected in enumerate(chain_outputs(layer, hidden, embeds, anchor,
                                                          num_steps)):
                # fp32, other reduction orders, weights of std 0.3: differences
                # reach 0.9e-5 (measured); a wrong mask or chain is off by O(1)
                torch.testing.assert_close(ttt[step][0, anchor + step], expected,
                                           atol=1e-4, rtol=1e-4)


def test_llama_target_becomes_mimo_with_the_same_function(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    config = json.loads((tiny_model_dir / "config.json").read_text())
    layer = MtpLayer(MtpConfig.from_target(config))
    layer.reset_parameters(torch.Generator().manual_seed(0))
    out = write_mtp_model(tiny_model_dir, layer.checkpoint_tensors(0), 1, tmp_path / "m")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["MiMoForCausalLM"]
    assert (written["model_type"], written["num_nextn_predict_layers"]) == ("qwen2", 1)
    assert (out / "tokenizer.json").is_file()
    tensors, num_layers = read_mtp_tensors(out)
    assert num_layers == 1 and tensors.keys() == layer.checkpoint_tensors(0).keys()
    ids = torch.randint(3, 4096, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(ids).logits
        qwen2 = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "Qwen2ForCausalLM"
    torch.testing.assert_close(qwen2, llama, atol=1e-5, rtol=1e-5)
    # written again from the MiMo model: the old MTP layer is replaced, not kept twice
    again = write_mtp_model(out, layer.checkpoint_tensors(0), 1, tmp_path / "m2")
    assert read_mtp_tensors(again)[0].keys() == tensors.keys()


def test_unsupported_target_is_refused_by_name(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(MtpTargetError, match="Llama, Qwen2 or MiMo target"):
        write_mtp_model(tmp_path / "t", {}, 1, tmp_path / "o")


def test_training_learns_and_resumes(tmp_path, tiny_model_dir):
    synthetic_dataset(tmp_path / "d")

    def config(out, epochs=3):
        return TrainConfig(data=str(tmp_path / "d"), target=str(tiny_model_dir),
                           out=str(tmp_path / out), epochs=epochs, batch_size=4,
                           ttt_steps=2, eval_every=2, checkpoint_every=3,
                           held_out_fraction=0.2, lr=5e-3)
    straight = run_training(config("a"), log=lambda *_: None, trainer_cls=MtpTrainer)
    history = straight.state.history
    assert history[-1]["loss"][0] < history[0]["loss"][0]     # it learns
    killed = run_training(config("b"), log=lambda *_: None, stop_after=4,
                          trainer_cls=MtpTrainer)
    assert killed.state.step == 4 and not (tmp_path / "b" / "config.json").exists()
    resumed = run_training(config("b"), log=lambda *_: None, trainer_cls=MtpTrainer)
    for (name, a), b in zip(straight.head.state_dict().items(),
                            resumed.head.state_dict().values()):
        assert torch.equal(a, b), name
    assert read_mtp_tensors(tmp_path / "b")[1] == 1


def test_mtp_training_needs_the_last_layer(tmp_path, tiny_model_dir):
    from vllm_specplug.extraction import dataset as ds

    root = tmp_path / "d"
    root.mkdir()
    ds.DatasetInfo("tiny", [2, 3, 4], 128, "float32", 6).save(root)
    with pytest.raises(ValueError, match=r"needs the last layer \(6\)"):
        MtpTrainer(TrainConfig(data=str(root), target=str(tiny_model_dir),
                               out=str(tmp_path / "o")))


def test_train_mtp_cli_refuses_bad_input_with_named_errors(tmp_path, tiny_model_dir, capsys):
    from vllm_specplug.cli.main import main
    from vllm_specplug.extraction import dataset as ds

    root = tmp_path / "d"
    root.mkdir()
    ds.DatasetInfo("tiny", [2, 3, 4], 128, "float32", 6).save(root)
    args = ["train-mtp", "--data", str(root), "--out", str(tmp_path / "o")]
    assert main(args + ["--target", str(tiny_model_dir)]) == 2
    assert "needs the last layer (6)" in capsys.readouterr().err
    synthetic_dataset(tmp_path / "d2")
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "hidden_size": 128,
         "vocab_size": 4096}))
    shutil.copy(tiny_model_dir / "model.safetensors", other / "model.safetensors")
    assert main(["train-mtp", "--data", str(tmp_path / "d2"), "--out", str(tmp_path / "o2"),
                 "--target", str(other)]) == 2
    assert "Llama, Qwen2 or MiMo target" in capsys.readouterr().err
