"""`build_resumable`: an interrupted build keeps its work folder, the next
call resumes from it, and only a whole build appears under its final name."""
from __future__ import annotations

import pytest

from vllm_specplug.models.build import BUILD_INFO_FILE, build_resumable


def test_an_interrupted_build_resumes_and_only_a_whole_build_is_final(tmp_path):
    final = tmp_path / "models" / "thing-123"
    calls = []

    def build(work):
        calls.append(sorted(p.name for p in work.iterdir()))
        if not (work / "step1").exists():
            (work / "step1").write_text("done")
            raise KeyboardInterrupt  # killed after the first step
        (work / BUILD_INFO_FILE).write_text("{}")

    with pytest.raises(KeyboardInterrupt):
        build_resumable(final, build)
    assert not final.exists()
    assert build_resumable(final, build) == final
    assert calls == [[], ["step1"]]  # the second run found the first one's work
    assert (final / "step1").read_text() == "done" and (final / BUILD_INFO_FILE).is_file()
    assert build_resumable(final, build) == final and len(calls) == 2  # cached


def test_a_build_that_writes_no_info_is_not_final(tmp_path):
    final = tmp_path / "models" / "thing-456"
    with pytest.raises(RuntimeError, match="wrote no specplug_build.json"):
        build_resumable(final, lambda work: None)
    assert not final.exists()
