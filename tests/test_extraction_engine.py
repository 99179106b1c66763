"""Hidden-state extraction in a real engine, checked against transformers.

One extraction engine (our connector + vLLM's `extract_hidden_states` method)
serves the module; the kill test runs `vllm-specplug extract` as a subprocess
(it is killed), then resumes on the module's engine.
"""
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer
from vllm import SamplingParams

from vllm_specplug.cli.main import main
from vllm_specplug.extraction import dataset as ds
from vllm_specplug.extraction.pipeline import (ExtractOptions, STAGING_DIR,
                                               make_extraction_llm, prepare_output,
                                               run_extract, wait_for_files)
from vllm_specplug.extraction.prompts import template_for_generation
from vllm_specplug.models.corpus import (chat_conversations, held_out_prompts,
                                         train_prompts)
from vllm_specplug.testing.engine import shutdown_llm
from vllm_specplug.testing.hf_reference import hf_hidden_states, load_hf_model

MAX_NEW_TOKENS = 24
ATOL = RTOL = 1e-4   # float32 model; vLLM and transformers kernels differ


def write_prompts(path, conversations, extra_lines=()):
    lines = [json.dumps(c) for c in conversations] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def extraction(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("extract")
    conversations = chat_conversations(held_out_prompts(6))
    options = ExtractOptions(
        model=str(tiny_model_dir), out=str(root / "data"), regenerate=True,
        storage_root=str(root),     # lets other outputs under root share the engine
        prompts=write_prompts(root / "prompts.jsonl", conversations),
        max_new_tokens=MAX_NEW_TOKENS, batch_size=4, max_model_len=1024)
    llm = make_extraction_llm(options, prepare_output(options))
    report = run_extract(options, llm=llm)
    yield options, llm, report, conversations
    shutdown_llm(llm)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return load_hf_model(tiny_model_dir)


def test_hidden_states_equal_a_transformers_forward(extraction, hf_model):
    options, _, report, conversations = extraction
    dataset = ds.HiddenStatesDataset(options.out)
    assert len(dataset) == len(conversations) == report.num_samples
    assert dataset.info.layer_ids == [2, 3, 4, 6]    # EAGLE-3 layers + last
    for item in dataset:
        expected = hf_hidden_states(hf_model, item["input_ids"], dataset.info.layer_ids)
        assert item["hidden_states"].dtype == torch.float32
        torch.testing.assert_close(item["hidden_states"], expected, atol=ATOL, rtol=RTOL)


def test_a_sharded_target_writes_the_same_samples(extraction, tmp_path_factory):
    """Extraction with the target over 2 ranks (CPU): one file per request,
    the same tokens and, within fp32 reduction order, the same hidden
    states as at one rank (the module's extraction)."""
    import dataclasses

    options, _, report, conversations = extraction
    root = tmp_path_factory.mktemp("extract_tp2")
    sharded = dataclasses.replace(
        options, out=str(root / "data"), storage_root=str(root),
        prompts=write_prompts(root / "prompts.jsonl", conversations),
        engine_kwargs={**options.engine_kwargs, "tensor_parallel_size": 2})
    llm = make_extraction_llm(sharded, prepare_output(sharded))
    try:
        assert run_extract(sharded, llm=llm).num_samples == report.num_samples
    finally:
        shutdown_llm(llm)
    one, two = ds.HiddenStatesDataset(options.out), ds.HiddenStatesDataset(sharded.out)
    assert sorted(p.name for p in (root / "data" / STAGING_DIR).iterdir()) == []  # all sharded
    assert len(two) == len(one)
    for a, b in zip(sorted(one, key=lambda i: i["input_ids"].tolist()),
                    sorted(two, key=lambda i: i["input_ids"].tolist())):
        assert torch.equal(a["input_ids"], b["input_ids"])
        torch.testing.assert_close(b["hidden_states"], a["hidden_states"], atol=ATOL, rtol=RTOL)


def test_tokens_are_the_template_plus_the_targets_greedy_reply(
        extraction, baseline_llm, tiny_model_dir):
    options, _, _, conversations = extraction
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    dataset = ds.HiddenStatesDataset(options.out)
    by_line = {r.source_line: i for i, r in enumerate(dataset.records)}
    prompts = [template_for_generation(tokenizer, c["messages"]) for c in conversations]
    replies = baseline_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0), use_tqdm=False)
    for line, (prompt, reply) in enumerate(zip(prompts, replies), start=1):
        item = dataset[by_line[line]]
        response = list(reply.outputs[0].token_ids)
        assert item["input_ids"].tolist() == prompt + response
        assert item["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(response)


def test_connector_saves_prompt_and_response_in_one_pass(extraction, hf_model):
    options, llm, _, _ = extraction
    storage = options.storage_root
    out = llm.generate(["def parse(text):\n    "],
                       SamplingParams(max_tokens=12, temperature=0.0,
                                      extra_args={"kv_transfer_params": {
                                          "hidden_states_path": "direct/one.safetensors"}}),
                       use_tqdm=False)[0]
    path = out.kv_transfer_params["hidden_states_path"]
    assert path == os.path.join(os.path.realpath(storage), "direct", "one.safetensors")
    wait_for_files([path])
    saved = load_file(path)
    # every token that was fed to the model: prompt + all but the last reply token
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1]
    assert saved["token_ids"].tolist() == ids
    assert out.kv_transfer_params["num_tokens"] == len(ids)
    with safe_open(path, "pt") as handle:
        assert json.loads(handle.metadata()["layer_ids"]) == [2, 3, 4, 6]
    torch.testing.assert_close(saved["hidden_states"],
                               hf_hidden_states(hf_model, ids, [2, 3, 4, 6]),
                               atol=ATOL, rtol=RTOL)
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n]


def test_connector_refuses_paths_outside_its_directory(extraction, tmp_path):
    options, llm, _, _ = extraction
    escape = os.path.relpath(tmp_path / "escaped.safetensors", options.storage_root)
    params = SamplingParams(max_tokens=2, extra_args={
        "kv_transfer_params": {"hidden_states_path": escape}})
    out = llm.generate(["import os"], params, use_tqdm=False)[0]
    assert "leaves the storage directory" in out.kv_transfer_params["hidden_states_error"]
    time.sleep(0.5)
    assert not (tmp_path / "escaped.safetensors").exists()
    # the engine keeps serving
    again = llm.generate(["import os"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(again.outputs[0].token_ids) == 2


def cli(*args, output):
    # Its own session, so the kill takes the engine processes with it, as a
    # `kill -9` of a job does; output to a file, not an unread (filling) pipe.
    return subprocess.Popen([sys.executable, "-m", "vllm_specplug.cli.main", "extract",
                             *args], stdout=output, stderr=output, text=True,
                            start_new_session=True)


def manifest_lines(out):
    path = os.path.join(out, ds.MANIFEST_FILE)
    return open(path).read().count("\n") if os.path.exists(path) else 0


def test_cli_killed_mid_run_resumes_without_loss_or_duplicates(extraction, tmp_path,
                                                              tiny_model_dir):
    options, llm, _, _ = extraction
    conversations = chat_conversations(train_prompts(24), with_answers=True)
    prompts = write_prompts(tmp_path / "p.jsonl", conversations,
                            extra_lines=['{"messages": [', '{"prompt": ""}'])
    out = os.path.join(options.storage_root, "killed")
    log = open(tmp_path / "first-run.log", "w")
    first = cli("--model", str(tiny_model_dir), "--prompts", prompts, "--out", out,
                "--batch-size", "2", output=log)
    deadline = time.monotonic() + 300
    while manifest_lines(out) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    log.close()
    assert first.returncode == -signal.SIGKILL, \
        f"the run ended before the kill: {open(log.name).read()[-2000:]}"
    assert 2 <= manifest_lines(out) < len(conversations)
    # The second run is the same pipeline, on the module's engine (saves a start).
    errors = io.StringIO()
    report = run_extract(ExtractOptions(model=str(tiny_model_dir), prompts=prompts,
                                        out=out, batch_size=2,
                                        storage_root=options.storage_root),
                         report_to=errors, llm=llm)
    assert report.num_resumed >= 2 and report.num_resumed + report.num_samples == 24
    assert "line 25: malformed JSON" in errors.getvalue()
    assert "line 26: empty prompt" in errors.getvalue()
    records = ds.read_manifest(out)
    assert sorted(r.source_line for r in records) == list(range(1, 25))
    assert manifest_lines(out) == len(records)          # no duplicate lines
    assert not os.listdir(os.path.join(out, STAGING_DIR))
    dataset = ds.HiddenStatesDataset(out)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for item, record in zip(dataset, dataset.records):
        assert item["hidden_states"].shape == (record.num_tokens, 4, 128)
        answer = conversations[record.source_line - 1]["messages"][1]["content"]
        masked = item["input_ids"][item["loss_mask"].bool()].tolist()
        assert tokenizer.decode(masked) == answer + "<|end|>\n"
    for shard in os.listdir(os.path.join(out, ds.SHARD_DIR)):
        with safe_open(os.path.join(out, ds.SHARD_DIR, shard), "pt") as handle:
            assert handle.get_slice("input_ids").get_shape()[0] > 0


def test_cli_rejects_bad_layers_before_any_work(tmp_path, tiny_model_dir, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", chat_conversations(["x = 1\n"]))
    out = tmp_path / "never"
    code = main(["extract", "--model", str(tiny_model_dir), "--prompts", prompts,
                 "--out", str(out), "--layers", "2", "9"])
    stderr = capsys.readouterr().err
    assert code == 2
    assert "eagle_aux_hidden_state_layer_ids [2, 9]" in stderr and "[0, 6]" in stderr
    assert not out.exists()


def test_cli_rejects_an_unwritable_output_directory(tmp_path, tiny_model_dir, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", chat_conversations(["x = 1\n"]))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(["extract", "--model", str(tiny_model_dir), "--prompts", prompts,
                 "--out", str(blocker / "data")])
    assert code == 2 and "cannot write there" in capsys.readouterr().err
