"""Bad input on `extract`, the dataset reader, `train-eagle3` and our head loader
(issue 14, item 4): each a named error naming the file and the fix, a non-zero
exit code without a traceback, and nothing already written lost."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.bad_input_helpers import (DAMAGED, DAMAGES, TINY, disk_bytes, sample,
                                     same_samples, small_dataset, tmpfs)  # noqa: F401
from tests.test_training_unit import synthetic_dataset, tiny_head
from vllm_specplug.cli.main import main
from vllm_specplug.extraction import dataset as ds
from vllm_specplug.extraction.repair import recover
from vllm_specplug.extraction import errors
from vllm_specplug.extraction.repair import QUARANTINE_DIR, ensure_info
from vllm_specplug.training.checkpoint import CheckpointError
from vllm_specplug.draft_models.eagle3_model import Eagle3Head, HeadLoadError
from vllm_specplug.training.trainer import TrainConfig, run_training

RERUN = "re-run `vllm-specplug extract` with the same arguments"
TRAIN_SHARDS = [[12, 14], [16], [11, 13], [15, 12]]   # s2 alone in shard-00001


# --- (a) damaged datasets: refused when opened, set aside by `extract` ---------

@pytest.mark.parametrize("kind", list(DAMAGES))
def test_reader_names_the_damage_when_the_dataset_opens(tmp_path, kind):
    small_dataset(tmp_path)
    damage, error_class, fragments = DAMAGES[kind]
    damage(tmp_path)
    with pytest.raises(error_class) as caught:
        ds.HiddenStatesDataset(tmp_path)
    assert isinstance(caught.value, errors.DatasetError)
    for fragment in fragments + [RERUN]:
        assert fragment in str(caught.value)


@pytest.mark.parametrize("kind", list(DAMAGES))
def test_extract_sets_the_damage_aside_and_keeps_every_intact_sample(tmp_path, kind):
    samples = small_dataset(tmp_path)
    intact = {p.name: p.read_bytes() for p in (tmp_path / ds.SHARD_DIR).iterdir()
              if p.name not in DAMAGED}
    DAMAGES[kind][0](tmp_path)
    notes = []
    assert [r.sample_id for r in recover(tmp_path, notes)] == ["s0", "s1", "s3", "s4"]
    assert notes and all(DAMAGED in n or "manifest" in n for n in notes), notes
    for name, data in intact.items():
        assert (tmp_path / ds.SHARD_DIR / name).read_bytes() == data
    assert same_samples(ds.HiddenStatesDataset(tmp_path), samples)
    if kind != "shard missing":     # the damaged bytes are kept, not deleted
        assert os.listdir(tmp_path / QUARANTINE_DIR)
    # the next run writes the lost sample again; a second repair finds nothing
    ds.write_shard(tmp_path, ds.next_shard_index(tmp_path), [samples["s2"]])
    again = []
    assert len(recover(tmp_path, again)) == 5 and again == []
    assert same_samples(ds.HiddenStatesDataset(tmp_path), samples)


@pytest.mark.parametrize("content", [None, '{"format": "vllm-specplug-hid', "[1, 2]",
                                     '{"model": "m", "layer_ids": "1,2"}'])
def test_dataset_json_missing_or_unreadable_is_written_again_by_extract(tmp_path,
                                                                        content):
    samples = small_dataset(tmp_path)
    path = tmp_path / ds.INFO_FILE
    path.unlink() if content is None else path.write_text(content)
    with pytest.raises(errors.DatasetInfoError) as caught:
        ds.HiddenStatesDataset(tmp_path)
    assert str(path) in str(caught.value) and RERUN in str(caught.value)
    notes = []
    ensure_info(tmp_path, ds.DatasetInfo("m", [1, 2], 4, "float32", 3), notes)
    assert len(notes) == 1 and ds.INFO_FILE in notes[0]
    assert same_samples(ds.HiddenStatesDataset(tmp_path), samples)


def test_shards_of_other_layers_are_refused_and_never_moved(tmp_path):
    small_dataset(tmp_path)
    (tmp_path / ds.INFO_FILE).unlink()
    other = ds.DatasetInfo("m", [1, 2, 3], 4, "float32", 3)
    with pytest.raises(errors.ShardMismatchError, match=r"hidden_states is F32 \[7, 2, 4\]"):
        ensure_info(tmp_path, other, [])
    assert not (tmp_path / ds.INFO_FILE).exists()
    other.save(tmp_path)
    for call in (ds.HiddenStatesDataset, lambda root: recover(root, [])):
        with pytest.raises(errors.ShardMismatchError, match="another model or --layers"):
            call(tmp_path)
    assert len(os.listdir(tmp_path / ds.SHARD_DIR)) == 3
    assert not (tmp_path / QUARANTINE_DIR).exists()


def test_damaged_tensor_bytes_are_named_when_the_sample_is_read(tmp_path):
    small_dataset(tmp_path)
    path = tmp_path / DAMAGED
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:8 + length])["input_ids"]["data_offsets"][0]
    data[8 + length + begin:8 + length + begin + 8] = b"\xff" * 8   # token id -1
    path.write_bytes(bytes(data))
    dataset = ds.HiddenStatesDataset(tmp_path)          # the header is intact
    with pytest.raises(errors.ShardError, match=r"shard-00001.safetensors: sample s2 "
                       r"\(manifest.jsonl:3\): negative token ids; delete this shard"):
        dataset[2]


def train_args(data, out, target, *extra):
    return ["train-eagle3", "--data", str(data), "--target", str(target), "--out",
            str(out), "--epochs", "3", "--batch-size", "4", "--eval-every", "2",
            "--checkpoint-every", "2", "--held-out-fraction", "0.2",
            "--draft-vocab-size", "256", *extra]


@pytest.mark.parametrize("kind", ["shard cut to half", "shard missing",
                                  "manifest line not JSON", "manifest line past its shard",
                                  "dataset.json unreadable", "token ids of another model"])
def test_train_eagle3_exits_2_naming_the_damage(tmp_path, tiny_model_dir, capsys, kind):
    small_dataset(tmp_path / "d", TRAIN_SHARDS, TINY)
    if kind == "dataset.json unreadable":
        (tmp_path / "d" / ds.INFO_FILE).write_text("{")
        fragments = ["dataset.json: unreadable", RERUN]
    elif kind == "token ids of another model":
        foreign = sample(9, 12, TINY)
        foreign.input_ids[3] = 9000
        ds.write_shard(tmp_path / "d", 4, [foreign])
        fragments = ["sample s9 has token id 9000", "the --target"]
    else:
        DAMAGES[kind][0](tmp_path / "d")
        fragments = DAMAGES[kind][2] + [RERUN]
    assert main(train_args(tmp_path / "d", tmp_path / "h", tiny_model_dir)) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and all(f in error for f in fragments), error
    assert not (tmp_path / "h" / "checkpoints").exists()


# --- (b) head directories with missing or mismatched tensors -----------------

def _drop(tensors, name):
    del tensors[name]
    return tensors


HEAD_DAMAGES = {
    "missing tensor": ("model", lambda t: _drop(t, "fc.weight"),
                       "missing tensors: fc.weight"),
    "unexpected tensor": ("model", lambda t: {**t, "extra.bias": torch.zeros(2)},
                          "unexpected tensors: extra.bias"),
    "mis-shaped tensor": ("model", lambda t: {**t, "lm_head.weight": torch.zeros(10, 32)},
                          "mis-shaped tensors: lm_head.weight [10, 32] torch.float32 "
                          "(expected [64, 32] torch.float32)"),
    "mis-typed tensor": ("model", lambda t: {**t, "d2t": t["d2t"].float()},
                         "mis-shaped tensors: d2t [64] torch.float32 (expected [64] "
                         "torch.int64)"),
    "model.safetensors cut short": ("raw", lambda b: b[:len(b) // 2],
                                    "not a readable safetensors file"),
    "model.safetensors missing": ("raw", None, "model.safetensors: missing"),
    "config.json from another tool": ("config", lambda c: _drop(c, "specplug_head_config"),
                                      "no usable specplug_head_config"),
    "config.json not JSON": ("config", lambda c: "{", "config.json: unreadable"),
}


@pytest.mark.parametrize("kind", list(HEAD_DAMAGES))
def test_head_loader_lists_what_is_wrong(tmp_path, kind):
    tiny_head().save_pretrained(tmp_path)
    where, edit, expected = HEAD_DAMAGES[kind]
    model, config = tmp_path / "model.safetensors", tmp_path / "config.json"
    if where == "model":
        save_file(edit(load_file(str(model))), str(model))
    elif where == "raw":
        model.write_bytes(edit(model.read_bytes())) if edit else model.unlink()
    else:
        edited = edit(json.loads(config.read_text()))
        config.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(HeadLoadError) as caught:
        Eagle3Head.from_pretrained(tmp_path)
    assert expected in str(caught.value) and "vllm-specplug train-eagle3" in str(caught.value)


def test_head_loader_lists_every_problem_at_once(tmp_path):
    tiny_head().save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = _drop(_drop(load_file(path), "norm.weight"), "t2d")
    save_file({**tensors, "x": torch.ones(1), "fc.weight": torch.ones(3)}, path)
    with pytest.raises(HeadLoadError, match=r"missing tensors: norm.weight, t2d; "
                       r"unexpected tensors: x; mis-shaped tensors: fc.weight \[3\]"):
        Eagle3Head.from_pretrained(tmp_path)


def test_damaged_checkpoint_names_the_file_and_the_way_back(tmp_path, tiny_model_dir):
    synthetic_dataset(tmp_path / "d")

    def config(out, draft_vocab_size=256, data="d"):
        return TrainConfig(data=str(tmp_path / data), target=str(tiny_model_dir),
                           out=str(tmp_path / out), epochs=3, batch_size=4, eval_every=2,
                           checkpoint_every=2, held_out_fraction=0.2,
                           draft_vocab_size=draft_vocab_size)
    quiet = {"log": lambda *_: None}
    straight = run_training(config("a"), **quiet)
    run_training(config("b"), stop_after=5, **quiet)     # checkpoints at steps 2, 4
    with pytest.raises(CheckpointError, match=r"mis-shaped tensors: d2t \[256\] .*, "
                       r"lm_head.weight \[256, 128\] torch.float32 \(expected \[100, 128\]"):
        run_training(config("b", draft_vocab_size=100), **quiet)
    synthetic_dataset(tmp_path / "other", seed=1)
    with pytest.raises(CheckpointError, match="draft vocabulary differs from the one "
                       f"--data {tmp_path / 'other'} gives now"):
        run_training(config("b", data="other"), **quiet)
    step4 = tmp_path / "b" / "checkpoints" / "step-00000004"
    path = str(step4 / "model.safetensors")
    save_file(_drop(load_file(path), "midlayer.mlp.up_proj.weight"), path)
    with pytest.raises(CheckpointError) as caught:
        run_training(config("b"), **quiet)
    assert f"{path}: missing tensors: midlayer.mlp.up_proj.weight" in str(caught.value)
    assert f"delete {step4} to resume from step 2" in str(caught.value)
    shutil.rmtree(step4)                                   # as the message says
    resumed = run_training(config("b"), **quiet)
    for (name, a), b in zip(straight.head.state_dict().items(),
                            resumed.head.state_dict().values()):
        assert torch.equal(a, b), name


# --- (c) failed writes: a clear error, exit 1, nothing written lost ---------

def test_failed_manifest_append_leaves_the_manifest_as_it_was(tmp_path, monkeypatch):
    samples = small_dataset(tmp_path)
    before = (tmp_path / ds.MANIFEST_FILE).read_bytes()
    extra, real_write = sample(9, 6), os.write

    def disk_full(fd, data):   # half a line gets out, then the disk is full
        real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with monkeypatch.context() as patch:
        patch.setattr(os, "write", disk_full)
        with pytest.raises(errors.OutputWriteError) as caught:
            ds.write_shard(tmp_path, 3, [extra])
    assert caught.value.errno == errno.ENOSPC
    assert f"cannot write {tmp_path / ds.MANIFEST_FILE}: ENOSPC" in str(caught.value)
    assert "re-run the same command" in str(caught.value)
    assert (tmp_path / ds.MANIFEST_FILE).read_bytes() == before
    assert not (tmp_path / ds.SHARD_DIR / "shard-00003.safetensors").exists()
    assert same_samples(ds.HiddenStatesDataset(tmp_path), samples)
    ds.write_shard(tmp_path, 3, [extra])                   # space is back
    assert same_samples(ds.HiddenStatesDataset(tmp_path), {**samples, "s9": extra})


def test_disk_full_while_writing_shards_keeps_the_dataset_valid(tmpfs):
    root = tmpfs.path / "data"
    samples = small_dataset(root)
    with pytest.raises(errors.OutputWriteError) as caught:
        for number in range(10, 40):                  # 20 kB each: 64 kB run out
            samples[f"s{number}"] = sample(number, 500)
            ds.write_shard(root, ds.next_shard_index(root), [samples[f"s{number}"]])
    assert caught.value.errno == errno.ENOSPC and number > 10
    assert f"cannot write {root / ds.SHARD_DIR}/shard-" in str(caught.value)
    assert ": ENOSPC (No space left on device); free space" in str(caught.value)
    failed = samples.pop(f"s{number}")
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name]
    notes = []
    assert len(recover(root, notes)) == len(samples) and notes == []
    assert same_samples(ds.HiddenStatesDataset(root), samples)
    tmpfs.resize(1 << 20)
    ds.write_shard(root, ds.next_shard_index(root), [failed])
    assert same_samples(ds.HiddenStatesDataset(root), {**samples, failed.sample_id: failed})


def test_disk_full_during_training_keeps_checkpoints_and_resumes(tmp_path, tmpfs,
                                                                 tiny_model_dir, capsys):
    synthetic_dataset(tmp_path / "d")
    assert main(train_args(tmp_path / "d", tmp_path / "a", tiny_model_dir)) == 0
    step = disk_bytes(sorted((tmp_path / "a" / "checkpoints").glob("step-*"))[-1])
    ranking = disk_bytes(tmp_path / "a" / "token_ranking.json")
    tmpfs.resize(ranking + 2 * step + step // 2)   # room for two checkpoints, not three
    out = tmpfs.path / "b"
    capsys.readouterr()
    assert main(train_args(tmp_path / "d", out, tiny_model_dir)) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: cannot write {out}/checkpoints/step-00000006") \
        and ": ENOSPC (No space left on device)" in error, error
    assert "re-run the same command" in error and "checkpoint is step 4" in error
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == \
        ["latest.json", "step-00000002", "step-00000004"]
    tmpfs.resize(64 << 20)                          # space freed
    assert main(train_args(tmp_path / "d", out, tiny_model_dir)) == 0
    assert "resumed from step 4" in capsys.readouterr().out
    assert (out / "model.safetensors").read_bytes() == \
        (tmp_path / "a" / "model.safetensors").read_bytes()


def test_output_under_a_regular_file_is_refused_before_any_work(tmp_path, tiny_model_dir,
                                                                capsys):
    synthetic_dataset(tmp_path / "d")
    (tmp_path / "file").write_text("")
    assert main(train_args(tmp_path / "d", tmp_path / "file" / "h", tiny_model_dir)) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"error: --out {tmp_path}/file/h: cannot write there (ENOTDIR: "
                     "Not a directory); choose a writable directory, or free space")


def test_read_only_output_is_refused_and_left_as_it_was(tmp_path, tmpfs, tiny_model_dir,
                                                        capsys):
    synthetic_dataset(tmp_path / "d")
    tmpfs.resize(64 << 20)
    out = tmpfs.path / "h"
    assert main(train_args(tmp_path / "d", out, tiny_model_dir)) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    tmpfs.remount("ro")                       # chmod does not stop root; this does
    more = train_args(tmp_path / "d", out, tiny_model_dir, "--epochs", "4")
    assert main(more) == 2
    assert f"error: --out {out}: cannot write there (EROFS: Read-only file system)" \
        in capsys.readouterr().err
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    assert main(["extract", "--model", str(tiny_model_dir), "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(tmpfs.path / "x")]) == 2
    assert "cannot write there (EROFS" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    tmpfs.remount("rw")
    assert main(more) == 0 and "resumed from step 9" in capsys.readouterr().out


def test_extract_reports_a_failed_write_with_exit_1(tmp_path, tiny_model_dir,
                                                    monkeypatch, capsys):
    from vllm_specplug.extraction import pipeline

    def disk_full(options, **_):
        raise errors.OutputWriteError(errno.ENOSPC, f"{options.out}/shards/x",
                                      os.strerror(errno.ENOSPC))
    monkeypatch.setattr(pipeline, "run_extract", disk_full)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    assert main(["extract", "--model", str(tiny_model_dir), "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.startswith(
        f"error: cannot write {tmp_path}/o/shards/x: ENOSPC (No space left on device); "
        "free space there")


@pytest.mark.parametrize("reason", [
    "OutputWriteError: cannot write /s/x: ENOSPC (No space left on device); free ...",
    "SafetensorError: Error while serializing: I/O error: No space left on device "
    "(os error 28)", ""])
def test_a_save_that_failed_on_the_worker_is_a_write_error(tmp_path, reason):
    from vllm_specplug.extraction.pipeline import (STAGING_DIR, _drop_packed_staging,
                                                   wait_for_files)

    path = tmp_path / STAGING_DIR / "L1-x.safetensors"
    path.parent.mkdir()
    (tmp_path / STAGING_DIR / "L1-x.safetensors.error").write_text(reason)
    with pytest.raises(errors.OutputWriteError) as caught:
        wait_for_files([path])
    assert f"cannot write {path}: " in str(caught.value)
    assert ("ENOSPC" if reason else "disk full?") in str(caught.value)
    _drop_packed_staging(tmp_path, set())      # a re-run starts without the marker
    assert not os.listdir(tmp_path / STAGING_DIR)


# --- (d) SIGKILL of the real `train-eagle3` process, then resume -------------

def test_train_eagle3_killed_mid_run_resumes_bit_identical(tmp_path, tiny_model_dir):
    synthetic_dataset(tmp_path / "d", num_samples=16)

    def start(out):
        args = train_args(tmp_path / "d", out, tiny_model_dir)
        args[args.index("--epochs") + 1] = "8"    # 8 x 4 steps, a checkpoint every 2
        log = open(f"{out}.log", "a")
        return subprocess.Popen([sys.executable, "-m", "vllm_specplug.cli.main", *args],
                                stdout=log, stderr=log, start_new_session=True)
    straight = start(tmp_path / "a")
    assert straight.wait(timeout=300) == 0
    killed = start(tmp_path / "b")
    deadline = time.monotonic() + 120      # kill between checkpoints, after step 10
    while _latest_step(tmp_path / "b") < 10 and killed.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(killed.pid, signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL, open(tmp_path / "b.log").read()[-2000:]
    assert not (tmp_path / "b" / "model.safetensors").exists()
    resumed = start(tmp_path / "b")
    assert resumed.wait(timeout=300) == 0, open(tmp_path / "b.log").read()[-2000:]
    step = int(open(tmp_path / "b.log").read().split("resumed from step ")[1].split()[0])
    assert 10 <= step < 32
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()


def _latest_step(out) -> int:
    try:
        return json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError):
        return -1
