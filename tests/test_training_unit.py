"""EAGLE-3 training pieces: draft vocabulary, TTT semantics, checkpoints, resume."""
import json

import pytest
import torch

from vllm_specplug.extraction import dataset as ds
from vllm_specplug.training.batches import collate, split_ids
from vllm_specplug.draft_models.eagle3_model import Eagle3Head, HeadConfig
from vllm_specplug.draft_models.target import TargetParts
from vllm_specplug.training.trainer import TrainConfig, layer_roles, run_training
from vllm_specplug.training.vocab import build_draft_vocab

H, NUM_LAYERS = 128, 6   # the built-in tiny target


def test_draft_vocab_keeps_the_most_frequent_tokens_and_maps_back():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7, 2])
    vocab = build_draft_vocab(counts, 4)
    assert vocab.target_ids.tolist() == [0, 2, 3, 6]
    draft_ids = torch.arange(4)
    assert torch.equal(draft_ids + vocab.d2t, vocab.target_ids)  # vLLM's mapping
    assert vocab.t2d(8).tolist() == [True, False, True, True, False, False, True, False]
    # ties break towards the lower id, unseen tokens last
    assert build_draft_vocab(torch.tensor([1, 3, 3, 0]), 2).target_ids.tolist() == [1, 2]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(counts, 9)


def tiny_head(seed=0, num_aux=3, draft_vocab=64):
    config = HeadConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=100,
                        draft_vocab_size=draft_vocab, target_hidden_size=16,
                        aux_layer_ids=list(range(1, num_aux + 1)), rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=256)
    head = Eagle3Head(config)
    head.reset_parameters(torch.Generator().manual_seed(seed))
    return head


def chain_logits(head, aux, embeds, anchor, num_steps):
    """Inference semantics, one token at a time: the draft's cache holds step-0
    keys up to the anchor, then each draft step appends its own key."""
    positions = torch.arange(embeds.shape[1])
    cos, sin = head.rope(positions)
    g = head.fc(aux)
    _, k0, v0 = head._qkv(embeds, g, cos, sin)
    keys, values = [k0[:, :, :anchor + 1]], [v0[:, :, :anchor + 1]]
    hidden, logits = g[:, anchor:anchor + 1], []
    for step in range(num_steps):
        p = anchor + step
        q, k, v = head._qkv(embeds[:, p:p + 1], hidden, cos[p:p + 1], sin[p:p + 1])
        if step > 0:
            keys.append(k)
            values.append(v)
        kk, vv = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        probs = torch.softmax(q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
        attn = head.midlayer.self_attn.o_proj((probs @ vv).transpose(1, 2).reshape(1, 1, -1))
        residual = attn + hidden
        out = head.midlayer.mlp(head.midlayer.post_attention_layernorm(residual)) + residual
        logits.append(head.lm_head(head.norm(out))[0, 0])
        hidden = out
    return logits


@pytest.mark.parametrize("num_tokens,num_steps", [(9, 3), (17, 4), (5, 1)])
def test_ttt_unroll_equals_token_by_token_drafting(num_tokens, num_steps):
    torch.manual_seed(num_tokens)
    head = tiny_head(seed=num_tokens)
    aux = torch.randn(1, num_tokens, 3 * 16)
    embeds = torch.randn(1, num_tokens, 32)
    with torch.no_grad():
        ttt = head(aux, embeds, torch.arange(num_tokens),
                   torch.ones(1, num_tokens, dtype=torch.bool), num_steps)
        for anchor in range(num_tokens - num_steps + 1):
            for step, expected in enumerate(chain_logits(head, aux, embeds, anchor,
                                                         num_steps)):
                torch.testing.assert_close(ttt[step][0, anchor + step], expected,
                                           atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_a_samples_logits():
    head = tiny_head()
    aux, embeds = torch.randn(1, 6, 48), torch.randn(1, 6, 32)
    valid = torch.ones(1, 6, dtype=torch.bool)
    with torch.no_grad():
        alone = head(aux, embeds, torch.arange(6), valid, 3)
        padded = head(torch.cat([aux, torch.randn(1, 4, 48)], 1),
                      torch.cat([embeds, torch.randn(1, 4, 32)], 1), torch.arange(10),
                      torch.cat([valid, torch.zeros(1, 4, dtype=torch.bool)], 1), 3)
    for a, b in zip(alone, padded):
        torch.testing.assert_close(b[:, :6], a, atol=1e-5, rtol=1e-5)


def test_saved_head_has_vllms_eagle3_layout(tmp_path):
    head = tiny_head()
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (64, 16)
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any("embed_tokens" in n or "inv_freq" in n for n in names)
    again = Eagle3Head.from_pretrained(tmp_path)
    for (name, a), b in zip(head.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_training_needs_the_last_layer():
    assert layer_roles([2, 3, 4, 6], 6) == ([0, 1, 2], 3)
    with pytest.raises(ValueError, match="last layer"):
        layer_roles([2, 3, 4], 6)


def synthetic_dataset(root, num_samples=12, seed=0):
    root.mkdir(parents=True, exist_ok=True)
    ds.DatasetInfo("tiny", [2, 3, 4, NUM_LAYERS], H, "float32", NUM_LAYERS).save(root)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        n = 10 + i % 7
        mask = torch.ones(n, dtype=torch.uint8)
        mask[:4] = 0
        samples.append(ds.Sample(f"s{i:02d}", i + 1,
                                 torch.randint(3, 4096, (n,), generator=gen),
                                 torch.randn(n, 4, H, generator=gen), mask))
    ds.write_shard(root, 0, samples)
    return samples


def test_batches_mark_rows_that_predict_response_tokens(tmp_path, tiny_model_dir):
    samples = synthetic_dataset(tmp_path / "d", num_samples=3)
    dataset = ds.HiddenStatesDataset(tmp_path / "d")
    batch = collate([dataset[i] for i in range(3)], TargetParts.load(tiny_model_dir),
                    [0, 1, 2], 3)
    for b, sample in enumerate(samples):
        n = sample.input_ids.numel()
        assert batch.loss_rows[b].tolist() == sample.loss_mask[2:].bool().tolist() + \
            [False] * (batch.loss_rows.shape[1] - n + 2)
        assert torch.equal(batch.target_last[b, :n - 1], sample.hidden_states[1:, 3])


def test_split_is_stable_and_disjoint():
    ids = [f"s{i}" for i in range(200)]
    train, held = split_ids(ids, 0.1)
    assert set(train).isdisjoint(held) and len(train) + len(held) == 200
    assert 5 <= len(held) <= 40 and split_ids(list(reversed(ids)), 0.1)[1] == sorted(
        held, key=lambda s: ids.index(s), reverse=True)


def test_resumed_training_equals_uninterrupted(tmp_path, tiny_model_dir):
    synthetic_dataset(tmp_path / "d")
    def config(out):
        return TrainConfig(data=str(tmp_path / "d"), target=str(tiny_model_dir),
                           out=str(tmp_path / out), epochs=3, batch_size=4,
                           eval_every=2, checkpoint_every=3, held_out_fraction=0.2)
    straight = run_training(config("a"), log=lambda *_: None)
    killed = run_training(config("b"), log=lambda *_: None, stop_after=5)
    assert killed.state.step == 5 and not (tmp_path / "b" / "model.safetensors").exists()
    resumed = run_training(config("b"), log=lambda *_: None)
    assert resumed.state.step == straight.state.step == straight.total_steps
    for (name, a), b in zip(straight.head.state_dict().items(),
                            resumed.head.state_dict().values()):
        assert torch.equal(a, b), name
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in straight.state.history]
    assert [{k: v for k, v in r.items() if k != "seconds"}
            for r in resumed.state.history] == strip
    assert (tmp_path / "b" / "model.safetensors").exists()


def test_cli_refuses_bad_training_input_with_named_errors(tmp_path, tiny_model_dir, capsys):
    from vllm_specplug.cli.main import main

    args = ["train-eagle3", "--target", str(tiny_model_dir), "--out", str(tmp_path / "h")]
    assert main(args + ["--data", str(tmp_path)]) == 2
    assert "not a vllm-specplug dataset" in capsys.readouterr().err
    root = tmp_path / "d"
    root.mkdir()
    ds.DatasetInfo("tiny", [2, 3, 4], H, "float32", NUM_LAYERS).save(root)
    assert main(args + ["--data", str(root)]) == 2
    assert "needs the last layer (6)" in capsys.readouterr().err
    assert main(args + ["--data", str(root), "--ttt-steps", "0"]) == 2
    assert "--ttt-steps must be >= 1" in capsys.readouterr().err


def test_prefetched_batches_equal_the_steps_own(tmp_path, tiny_model_dir):
    """The CUDA path collates step s+1 in a thread while step s trains: the
    batches it hands out are batch_at's, in order, also after a skip (resume)."""
    from vllm_specplug.training.trainer import Trainer, _Prefetcher

    synthetic_dataset(tmp_path / "d")
    trainer = Trainer(TrainConfig(data=str(tmp_path / "d"), target=str(tiny_model_dir),
                                  out=str(tmp_path / "h"), epochs=2, batch_size=4,
                                  held_out_fraction=0.2, device="cpu"))
    prefetch = _Prefetcher(trainer.batch_at, trainer.total_steps)
    for step in [0, 1, 2, 4, 5]:
        got, want = prefetch.take(step), trainer.batch_at(step)
        for name in ("aux_hidden", "embeds", "target_last", "loss_rows", "key_valid"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
    assert prefetch._pending is None      # nothing read past the last step


def test_training_device_is_checked_by_name(tmp_path, tiny_model_dir, capsys):
    from vllm_specplug.cli.main import main
    from vllm_specplug.training.trainer import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device gpu0: not a torch device"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="--device meta: training runs on cpu or cuda"):
        resolve_device("meta")
    synthetic_dataset(tmp_path / "d")
    if not torch.cuda.is_available():
        assert main(["train-eagle3", "--target", str(tiny_model_dir), "--data",
                     str(tmp_path / "d"), "--out", str(tmp_path / "h"),
                     "--device", "cuda"]) == 2
        assert "torch sees no CUDA GPU here; use --device cpu" in capsys.readouterr().err
        assert not (tmp_path / "h" / "model.safetensors").exists()
