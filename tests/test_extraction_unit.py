"""Extraction pieces without an engine: prompt files, templates, paths, dataset."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from vllm_specplug.extraction import dataset as ds
from vllm_specplug.extraction.repair import recover
from vllm_specplug.extraction.connector import check_layer_ids
from vllm_specplug.extraction.pipeline import default_layer_ids, eagle3_layer_ids
from vllm_specplug.extraction.prompts import (LineFormatError, read_prompt_file,
                                              template_conversation,
                                              template_for_generation)
from vllm_specplug.extraction.speculators import export_speculators
from vllm_specplug.extraction.storage import (StoragePathError, TMP_INFIX,
                                              resolve_inside)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_prompt_file_reports_bad_lines_and_keeps_the_rest(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "hello"}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "  "}]}),
        "",
        json.dumps([{"role": "robot", "content": "x"}]),
        json.dumps({"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo"}]}),
    ])
    lines, errors = read_prompt_file(path)
    assert [line.line_number for line in lines] == [1, 6]
    assert [e.line_number for e in errors] == [2, 3, 5]
    assert "malformed JSON" in str(errors[0]) and "line 2" in str(errors[0])
    assert "empty prompt" in str(errors[1])
    assert "role must be one of" in str(errors[2])
    assert len({line.sample_id for line in lines}) == 2


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Add two numbers."},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": "Now subtract."},
                {"role": "assistant", "content": "def sub(a, b): return a - b"}]
    templated = template_conversation(tokenizer, messages)
    ids, mask = templated.input_ids, templated.loss_mask
    assert len(ids) == len(mask)
    spans, start = [], None
    for i, bit in enumerate(mask + [0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append(tokenizer.decode(ids[start:i]))
            start = None
    # each span is the reply as the template writes it, end-of-turn included
    assert spans == [messages[2]["content"] + "<|end|>\n",
                     messages[4]["content"] + "<|end|>\n"]
    prompt = template_for_generation(tokenizer, messages[:2])
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])


def test_conversation_without_assistant_needs_regenerate(tokenizer):
    with pytest.raises(LineFormatError, match="--regenerate"):
        template_conversation(tokenizer, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("relative", ["../escape.safetensors", "/etc/passwd",
                                      "a/../../b", ""])
def test_paths_that_leave_the_storage_directory_are_refused(tmp_path, relative):
    with pytest.raises(StoragePathError, match="hidden_states_path"):
        resolve_inside(tmp_path, relative)


def test_symlink_out_of_storage_is_refused(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "link").symlink_to(tmp_path)
    with pytest.raises(StoragePathError):
        resolve_inside(tmp_path / "store", "link/x.safetensors")
    assert resolve_inside(tmp_path / "store", "sub/x.safetensors").parent.name == "sub"


@pytest.mark.parametrize("num_layers", [4, 6, 12, 32, 80])
def test_default_layers_are_distinct_and_in_range(num_layers):
    ids = default_layer_ids(num_layers)
    check_layer_ids(ids, num_layers)
    assert ids[-1] == num_layers and len(eagle3_layer_ids(num_layers)) == 3
    if num_layers >= 12:
        assert ids[:3] == [2, num_layers // 2, num_layers - 3]


@pytest.mark.parametrize("ids", [[7], [-1], [2, 2], []])
def test_bad_layer_ids_name_the_field(ids):
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        check_layer_ids(ids, 6)


def make_sample(i, num_tokens, layers=2, hidden=4):
    return ds.Sample(f"s{i}", i + 1, torch.arange(num_tokens) + 10 * i,
                     torch.randn(num_tokens, layers, hidden),
                     (torch.arange(num_tokens) % 2).to(torch.uint8))


def make_dataset(root, shards):
    root.mkdir(parents=True, exist_ok=True)
    ds.DatasetInfo("m", [1, 2], 4, "float32", 3).save(root)
    samples = {}
    for index, sizes in enumerate(shards):
        batch = [make_sample(len(samples) + j, n) for j, n in enumerate(sizes)]
        ds.write_shard(root, index, batch)
        samples.update({s.sample_id: s for s in batch})
    return samples


def test_dataset_reader_returns_each_sample(tmp_path):
    samples = make_dataset(tmp_path, [[3, 1, 5], [7], [2, 2]])
    dataset = ds.HiddenStatesDataset(tmp_path)
    assert len(dataset) == len(samples)
    for item in dataset:
        sample = samples[item["sample_id"]]
        for key in ds.KEYS:
            assert torch.equal(item[key], getattr(sample, key)), key
    subset = ds.HiddenStatesDataset(tmp_path, sample_ids=["s4"])
    assert [item["sample_id"] for item in subset] == ["s4"]


def test_recover_drops_unlisted_shards_partial_lines_and_temp_files(tmp_path):
    make_dataset(tmp_path, [[3, 4]])
    # a kill after the shard rename, before its manifest lines
    ds.save_safetensors_atomic({"input_ids": torch.arange(3)},
                               tmp_path / ds.SHARD_DIR / "shard-00001.safetensors")
    (tmp_path / ds.SHARD_DIR / f"shard-00002.safetensors{TMP_INFIX}99").write_text("x")
    with open(tmp_path / ds.MANIFEST_FILE, "a") as handle:
        handle.write('{"sample_id": "cut sh')
    records = recover(tmp_path)
    assert [r.sample_id for r in records] == ["s0", "s1"]
    assert sorted(p.name for p in (tmp_path / ds.SHARD_DIR).iterdir()) == \
        ["shard-00000.safetensors"]
    assert (tmp_path / ds.MANIFEST_FILE).read_text().endswith("}\n")
    assert ds.next_shard_index(tmp_path) == 1


def test_reader_refuses_a_directory_that_is_not_a_dataset(tmp_path):
    with pytest.raises(FileNotFoundError, match="vllm-specplug extract"):
        ds.HiddenStatesDataset(tmp_path)


def test_export_for_speculators_keeps_every_sample(tmp_path):
    samples = make_dataset(tmp_path / "d", [[3, 2], [4]])
    assert export_speculators(str(tmp_path / "d"), str(tmp_path / "e")) == 3
    config = json.loads((tmp_path / "e" / "data_config.json").read_text())
    assert config["layer_ids"] == [1, 2]
    for index, sample_id in enumerate(config["sample_ids"]):
        with safe_open(str(tmp_path / "e" / f"data_{index}.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor("token_ids"), samples[sample_id].input_ids)
            assert torch.equal(f.get_tensor("hidden_states"),
                               samples[sample_id].hidden_states)


def test_corrupt_manifest_line_names_file_and_line(tmp_path):
    make_dataset(tmp_path, [[3, 4]])
    manifest = tmp_path / ds.MANIFEST_FILE
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text(lines[0] + '{"sample_id": 3, "bogus": true}\n')
    with pytest.raises(ValueError, match=r"manifest.jsonl:2: corrupt manifest line"):
        ds.HiddenStatesDataset(tmp_path)


def test_staging_copies_of_packed_samples_are_dropped(tmp_path):
    from vllm_specplug.extraction.pipeline import STAGING_DIR, _drop_packed_staging

    make_dataset(tmp_path, [[3, 4]])
    staging = tmp_path / STAGING_DIR
    staging.mkdir()
    for name in ("s0", "s1", "s7"):   # s0, s1 are packed; s7 is not yet
        ds.save_safetensors_atomic({"token_ids": torch.arange(3)},
                                   staging / f"{name}.safetensors")
    _drop_packed_staging(tmp_path, {r.sample_id for r in recover(tmp_path)})
    assert [p.name for p in staging.iterdir()] == ["s7.safetensors"]


def test_a_failed_save_is_raised_once_every_save_of_the_batch_finished(tmp_path):
    """The reason is raised only after the batch's other saves landed (file
    or marker): raised at once, a save still pending then left its marker
    after the repeated run had cleared the stale ones, and failed that run
    (CI, a disk that filled up)."""
    import threading
    from pathlib import Path

    from vllm_specplug.extraction.connector import error_marker_path
    from vllm_specplug.extraction.pipeline import wait_for_files

    failed, late = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    late_marker = Path(error_marker_path(str(late)))
    Path(error_marker_path(str(failed))).write_text("OSError: No space left on device")
    writer = threading.Timer(0.3, lambda: late_marker.write_text("OSError: No space left"))
    writer.start()
    try:
        with pytest.raises(RuntimeError, match="No space left on device"):
            wait_for_files([failed, late])
        assert late_marker.exists()  # it waited for the second save
    finally:
        writer.join()


def test_waiting_for_a_file_whose_save_failed_raises_the_reason(tmp_path):
    from vllm_specplug.extraction.connector import error_marker_path
    from vllm_specplug.extraction.pipeline import wait_for_files

    path = tmp_path / "x.safetensors"
    with open(error_marker_path(str(path)), "w") as handle:
        handle.write("OSError: No space left on device")
    with pytest.raises(RuntimeError, match="No space left on device"):
        wait_for_files([path])
