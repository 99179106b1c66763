"""A real `extract` run whose disk fills up mid-run (one engine, 4 prompts):
a named write error, every finished shard kept, and a re-run resumes."""
import errno
import io
import json
import os

import pytest

from tests.bad_input_helpers import tmpfs  # noqa: F401
from vllm_specplug.extraction import dataset as ds
from vllm_specplug.extraction import errors, pipeline
from vllm_specplug.extraction.pipeline import (STAGING_DIR, ExtractOptions,
                                               make_extraction_llm, prepare_output,
                                               run_extract)
from vllm_specplug.models.corpus import chat_conversations, train_prompts
from vllm_specplug.testing.engine import shutdown_llm


@pytest.fixture
def extraction(tmp_path, tmpfs, tiny_model_dir):
    tmpfs.resize(16 << 20)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in chat_conversations(
        train_prompts(4), with_answers=True)))
    options = ExtractOptions(model=str(tiny_model_dir), prompts=str(prompts),
                             out=str(tmpfs.path / "data"), batch_size=2,
                             max_new_tokens=8, max_model_len=512)
    llm = make_extraction_llm(options, prepare_output(options))
    yield options, llm, tmpfs
    shutdown_llm(llm)


def test_extract_on_a_disk_that_fills_up_resumes_once_space_is_freed(extraction,
                                                                     monkeypatch):
    options, llm, fs = extraction
    batches, real_batch, filler = [], pipeline._extract_batch, []

    def fill_before_the_second_batch(*args, **kwargs):
        batches.append(1)
        if len(batches) == 2:        # the worker's staging writes now fail
            filler.append(fs.fill(leave=8192))
        return real_batch(*args, **kwargs)
    monkeypatch.setattr(pipeline, "_extract_batch", fill_before_the_second_batch)
    with pytest.raises(errors.OutputWriteError) as caught:
        run_extract(options, report_to=io.StringIO(), llm=llm)
    message = str(caught.value)
    assert caught.value.errno == errno.ENOSPC, message
    assert f"cannot write {fs.path}/data/{STAGING_DIR}/" in message
    assert "ENOSPC (No space left on device, on the engine's worker)" in message
    assert "re-run the same command" in message
    first = ds.HiddenStatesDataset(options.out)          # the first shard is intact
    assert len(first) == 2
    monkeypatch.undo()
    filler[0].unlink()                                    # space freed
    report = run_extract(options, report_to=io.StringIO(), llm=llm)
    assert (report.num_resumed, report.num_samples) == (2, 2)
    dataset = ds.HiddenStatesDataset(options.out)
    assert sorted(r.source_line for r in dataset.records) == [1, 2, 3, 4]
    assert dataset.records[:2] == first.records
    assert not os.listdir(os.path.join(options.out, STAGING_DIR))   # no stale marker
