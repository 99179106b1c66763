"""Prompts file -> sharded hidden-state dataset, resumable (`vllm-specplug extract`).

Per batch of samples: (with `regenerate`) the target writes the final assistant
turn; then one prefill of each whole templated conversation goes through our
connector, which leaves one complete file per sample in `DIR/staging/`; the
batch becomes one shard, listed in the manifest, and its staging files go.
A killed run loses nothing finished: staging files are whole (atomic rename)
and are packed on the next run without recomputing; shards become visible only
through the manifest.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_specplug.extraction import dataset as ds
from vllm_specplug.extraction import repair
from vllm_specplug.extraction.connector import (CONNECTOR_NAME, ERROR_SUFFIX,
                                                HIDDEN_STATES_KEY, TOKEN_IDS_KEY,
                                                check_layer_ids, error_marker_path)
from vllm_specplug.extraction.errors import OutputWriteError, errno_in
from vllm_specplug.extraction.prompts import (LineError, LineFormatError, PromptLine,
                                              Templated,
                                              read_prompt_file, template_conversation,
                                              template_for_generation, with_response)
from vllm_specplug.extraction.repair import ensure_info
from vllm_specplug.extraction.storage import check_writable_dir

logger = logging.getLogger("vllm_specplug.extract")
STAGING_DIR = "staging"
FILE_WAIT_S = 120.0


@dataclass
class ExtractOptions:
    model: str
    prompts: str
    out: str
    layer_ids: list[int] | None = None
    regenerate: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0
    batch_size: int = 32
    max_model_len: int = 2048
    # The connector's shared_storage_path; OUT/staging must lie inside it.
    # Default OUT/staging. A common root lets one engine serve several outputs.
    storage_root: str | None = None
    engine_kwargs: dict = field(default_factory=dict)

    @property
    def storage(self) -> Path:
        return Path(self.storage_root or Path(self.out) / STAGING_DIR).resolve()


@dataclass
class ExtractReport:
    num_samples: int = 0          # written by this run
    num_tokens: int = 0
    num_resumed: int = 0          # already in the manifest
    num_recovered: int = 0        # packed from staging files of a killed run
    errors: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)   # damage set aside at start
    seconds: float = 0.0
    extract_seconds: float = 0.0  # the hidden-state prefills alone
    bytes_on_disk: int = 0


def eagle3_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's (2, n//2, n-3), or evenly spaced ids when those collide."""
    n = num_hidden_layers
    ids = [2, n // 2, n - 3]
    if len(set(ids)) == 3 and all(1 <= i < n for i in ids):
        return ids
    return sorted({max(1, min(n - 1, round(n * k / 4))) for k in (1, 2, 3)})


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """The EAGLE-3 layers plus the last layer (before the final norm)."""
    return eagle3_layer_ids(num_hidden_layers) + [num_hidden_layers]


def model_num_layers(model: str) -> tuple[int, int, str]:
    config = json.loads((Path(model) / "config.json").read_text())
    text = config.get("text_config", config)
    return (int(text["num_hidden_layers"]), int(text["hidden_size"]),
            str(text.get("dtype") or text.get("torch_dtype") or "float32"))


def prepare_output(options: ExtractOptions,
                   notes: list[str] | None = None) -> ds.DatasetInfo:
    """Everything checkable before an engine starts: layers, directory, info.
    Repairs of dataset.json are appended to `notes`."""
    if not (Path(options.model) / "config.json").exists():
        raise ValueError(f"--model {options.model}: no config.json there; give a "
                         "local Hugging Face model directory")
    num_layers, hidden_size, dtype = model_num_layers(options.model)
    layer_ids = options.layer_ids or default_layer_ids(num_layers)
    check_layer_ids(layer_ids, num_layers)
    info = ds.DatasetInfo(str(Path(options.model).resolve()), list(layer_ids),
                          hidden_size, dtype, num_layers)
    out = Path(options.out)
    for directory in (out, out / STAGING_DIR, out / ds.SHARD_DIR):
        check_writable_dir(directory)
    staging = (out / STAGING_DIR).resolve()
    if staging != options.storage and options.storage not in staging.parents:
        raise ValueError(f"--out {out}: its staging directory {staging} is not inside "
                         f"the connector's storage {options.storage}")
    ensure_info(out, info, notes if notes is not None else [])
    return info


def make_extraction_llm(options: ExtractOptions, info: ds.DatasetInfo):
    from vllm_specplug.engine import make_llm

    # its own core process: the connector writes a finished request's file
    # one engine step later, and an in-process core takes no step once
    # `generate` has returned
    return make_llm(
        options.model, own_process=True, dtype=info.dtype,
        max_model_len=options.max_model_len,
        speculative_config={
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": info.layer_ids}}},
        kv_transfer_config={
            "kv_connector": CONNECTOR_NAME, "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": str(options.storage)}},
        **options.engine_kwargs)


def staging_path(out: str | Path, sample_id: str) -> Path:
    return Path(out) / STAGING_DIR / f"{sample_id}.safetensors"


def run_extract(options: ExtractOptions, report_to=sys.stderr,
                llm=None) -> ExtractReport:
    """`llm`: an engine from `make_extraction_llm` for the same output directory
    (reused, not shut down); by default one is started and stopped here."""
    start = time.perf_counter()
    report = ExtractReport()
    info = prepare_output(options, report.repairs)
    done = {r.sample_id for r in repair.recover(options.out, report.repairs)}
    for note in report.repairs:
        print(f"repaired: {note}", file=report_to)
    _drop_packed_staging(options.out, done)
    lines, line_errors = read_prompt_file(options.prompts)
    _report_errors(line_errors, report, report_to)
    todo = [line for line in lines if line.sample_id not in done]
    report.num_resumed = len(lines) - len(todo)
    if todo:
        _extract_all(options, info, todo, report, report_to, llm)
    report.seconds = time.perf_counter() - start
    report.bytes_on_disk = sum(p.stat().st_size for p in
                               (Path(options.out) / ds.SHARD_DIR).glob("*.safetensors"))
    return report


def _drop_packed_staging(out, done: set[str]) -> None:
    """A kill between a shard's manifest lines and the deletion of its staging
    files leaves copies of samples that are already in the dataset; a failed
    save (disk full) leaves an error marker, stale once the run is repeated."""
    for path in (Path(out) / STAGING_DIR).glob("*.safetensors"):
        if path.stem in done:
            path.unlink()
    for path in (Path(out) / STAGING_DIR).glob(f"*{ERROR_SUFFIX}"):
        path.unlink()


def _report_errors(errors: list, report: ExtractReport, report_to) -> None:
    for error in errors:
        report.errors.append(str(error))
        print(f"skipped {error}", file=report_to)


def _extract_all(options, info, todo: list[PromptLine], report, report_to,
                 llm=None) -> None:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(options.model)
    owned = llm is None
    llm = make_extraction_llm(options, info) if owned else llm
    try:
        with tqdm(total=len(todo), desc="extract", unit="sample") as bar:
            for i in range(0, len(todo), options.batch_size):
                batch = todo[i:i + options.batch_size]
                samples = _extract_batch(llm, tokenizer, options, batch, report,
                                         report_to)
                if samples:
                    ds.write_shard(options.out, ds.next_shard_index(options.out),
                                   samples)
                    for sample in samples:
                        staging_path(options.out, sample.sample_id).unlink()
                    report.num_samples += len(samples)
                    report.num_tokens += sum(s.input_ids.numel() for s in samples)
                bar.update(len(batch))
    finally:
        if owned:
            from vllm_specplug.engine import shutdown_llm
            shutdown_llm(llm)


def _extract_batch(llm, tokenizer, options, batch: list[PromptLine], report,
                   report_to) -> list[ds.Sample]:
    """Samples of one batch, in order; a sample that cannot be made is reported."""
    staged = {line.sample_id for line in batch
              if staging_path(options.out, line.sample_id).exists()}
    report.num_recovered += len(staged)
    pending = [line for line in batch if line.sample_id not in staged]
    conversations, errors = _templated(llm, tokenizer, options, pending)
    _report_errors(errors, report, report_to)
    start = time.perf_counter()
    _prefill_to_staging(llm, options, {sid: t.input_ids for sid, t in
                                       conversations.items()})
    wait_for_files([staging_path(options.out, sid) for sid in conversations])
    report.extract_seconds += time.perf_counter() - start
    return [_load_sample(tokenizer, options, line, conversations.get(line.sample_id))
            for line in batch if line.sample_id in staged or line.sample_id in conversations]


def _templated(llm, tokenizer, options, lines: list[PromptLine]):
    """sample_id -> the whole templated conversation, and the line errors."""
    conversations, prompts, errors = {}, {}, []
    for line in lines:
        try:
            if options.regenerate:
                prompts[line.sample_id] = template_for_generation(tokenizer,
                                                                  line.messages)
            else:
                conversations[line.sample_id] = template_conversation(
                    tokenizer, line.messages)
        except LineFormatError as error:
            errors.append(LineError(line.line_number, str(error)))
    if prompts:
        for sample_id, response in _generate(llm, options, prompts).items():
            conversations[sample_id] = with_response(prompts[sample_id], response)
    for line in lines:
        templated = conversations.get(line.sample_id)
        if templated and len(templated.input_ids) >= options.max_model_len:
            del conversations[line.sample_id]
            errors.append(LineError(line.line_number, f"{len(templated.input_ids)} tokens "
                                    f"do not fit --max-model-len {options.max_model_len}"))
    return conversations, errors


def _generate(llm, options, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=options.max_new_tokens, temperature=options.temperature, seed=0,
        extra_args={"kv_transfer_params": {"save_hidden_states": False}})
    ids = list(prompts)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in ids], params,
                           use_tqdm=False)
    return {i: list(o.outputs[0].token_ids) for i, o in zip(ids, outputs)}


def _prefill_to_staging(llm, options, conversations: dict[str, list[int]]) -> None:
    from vllm import SamplingParams

    ids = list(conversations)
    relative = {sid: os.path.relpath(staging_path(options.out, sid).resolve(),
                                     options.storage) for sid in ids}
    params = [SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
        "hidden_states_path": relative[sid], "include_output_tokens": False}})
        for sid in ids]
    outputs = llm.generate([{"prompt_token_ids": conversations[i]} for i in ids],
                           params, use_tqdm=False)
    for out in outputs:
        error = (out.kv_transfer_params or {}).get("hidden_states_error")
        if error:
            raise RuntimeError(f"hidden-state extraction refused: {error}")


def wait_for_files(paths: list[str | Path]) -> None:
    """Until the worker wrote each of `paths` or its error marker (one engine
    step after the request finished); then the first failure is raised. It
    waits for every save of the batch, failed or not: a save still pending
    when the run stopped would leave its marker after a repeated run had
    cleared the stale ones, and fail that run (seen in CI on a disk that
    filled up: the second file's marker landed in the resumed run)."""
    paths = [Path(p) for p in paths]
    markers = [Path(error_marker_path(str(p))) for p in paths]
    deadline = time.monotonic() + FILE_WAIT_S
    while not all(p.exists() or m.exists() for p, m in zip(paths, markers)):
        if time.monotonic() > deadline:
            _raise_failed_save(paths, markers)
            missing = [str(p) for p, m in zip(paths, markers) if not (p.exists() or m.exists())]
            raise TimeoutError(f"hidden-state files not written after {FILE_WAIT_S} s: "
                               f"{missing[:3]} (see the engine log)")
        time.sleep(0.02)
    _raise_failed_save(paths, markers)


def _raise_failed_save(paths: list[Path], markers: list[Path]) -> None:
    for path, marker in zip(paths, markers):
        if not path.exists() and marker.exists():
            raise _save_failed(path, marker.read_text())


def _save_failed(path: Path, reason: str) -> Exception:
    """The worker's reason for a failed save; a failed write (disk full, ...)
    becomes an OutputWriteError, which `extract` reports with exit code 1."""
    number = errno_in(reason)
    if number is None and reason:
        return RuntimeError(f"saving {path} failed on the engine's worker: {reason}")
    detail = os.strerror(number) if number else "no reason recorded: disk full?"
    return OutputWriteError(number, path, f"{detail}, on the engine's worker")


def _load_sample(tokenizer, options, line: PromptLine,
                 templated: Templated | None) -> ds.Sample:
    """`templated`: None for a staging file left by an earlier run, whose
    conversation is templated again here (and must still match)."""
    tensors = load_file(str(staging_path(options.out, line.sample_id)))
    input_ids = tensors[TOKEN_IDS_KEY].to(torch.int64)
    if templated is None and options.regenerate:
        prompt_ids = template_for_generation(tokenizer, line.messages)
        templated = with_response(prompt_ids, input_ids[len(prompt_ids):].tolist())
    elif templated is None:
        templated = template_conversation(tokenizer, line.messages)
    if templated.input_ids != input_ids.tolist():
        raise RuntimeError(f"line {line.line_number}: staged tokens differ from the "
                           "templated conversation (prompts file changed?)")
    return ds.Sample(line.sample_id, line.line_number, input_ids,
                     tensors[HIDDEN_STATES_KEY],
                     torch.tensor(templated.loss_mask, dtype=torch.uint8))
