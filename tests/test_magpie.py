"""Magpie prompts: the target writes its own training prompts, disjoint from
the benchmark sets (training/magpie.py), on the shared tiny engine."""
from __future__ import annotations

import json
from dataclasses import dataclass

from vllm_specplug.training.magpie import (MagpieReport, _keep, sample_prompts,
                                           user_prefix_ids, word_ngrams, write_prompts_file)

MAX_ROUNDS = 60  # of 8 samples or more each


def test_the_prefix_stops_where_the_user_text_starts(baseline_llm):
    tokenizer = baseline_llm.get_tokenizer()
    prefix = user_prefix_ids(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}],
                                         tokenize=False)
    assert text.startswith(tokenizer.decode(prefix))
    assert text[len(tokenizer.decode(prefix)):].startswith("hello there")


@dataclass
class _Sampled:
    finish_reason: str


def test_keep_counts_every_reason_to_drop():
    report, seen = MagpieReport(), set()
    banned = {"bench": word_ngrams("one two three four five six seven eight nine")}
    assert _keep("Write a poem about the sea, please.", _Sampled("stop"), seen, banned, report)
    assert not _keep("write a poem about the  SEA, please.", _Sampled("stop"), seen, banned,
                     report)
    assert not _keep("an unfinished prompt that ran out", _Sampled("length"), seen, banned,
                     report)
    assert not _keep("short", _Sampled("stop"), seen, banned, report)
    assert not _keep("so: One two three four five six seven eight, ok?", _Sampled("stop"),
                     seen, banned, report)
    assert _keep("one two three four five six seven, then stop", _Sampled("stop"), seen,
                 banned, report)  # 7 shared words: no shared 8-gram
    assert (report.num_duplicates, report.num_truncated, report.num_short,
            report.num_overlapping) == (1, 1, 1, {"bench": 1})


def test_sampled_prompts_are_distinct_and_disjoint_from_the_sets(baseline_llm, tmp_path):
    """The tiny target seldom ends a turn early and what it samples depends on
    how the shared engine batched the requests (they reach its process one by
    one), so how many prompts it keeps varies: the test checks the accounting
    and the filters on whatever it kept. About 1 sample in 27 is kept; with
    the default 20 rounds (160 samples) none was in one CI run (2026-11-29).
    MAX_ROUNDS rounds make that about e^-17 (rounds stop once enough are kept)."""
    # A "benchmark" built from what the target tends to write: the filter must bite.
    first, _ = sample_prompts(baseline_llm, 2, {}, max_tokens=96, max_rounds=MAX_ROUNDS)
    assert first
    exclude = {"bench": first[:2]}
    prompts, report = sample_prompts(baseline_llm, 3, exclude, max_tokens=96,
                                     max_rounds=MAX_ROUNDS)
    assert 1 <= len(prompts) == report.num_kept <= 3
    assert report.num_sampled == (report.num_kept + report.num_truncated + report.num_short
                                  + report.num_duplicates + report.num_unused
                                  + sum(report.num_overlapping.values()))
    assert len({" ".join(p.lower().split()) for p in prompts}) == len(prompts)
    banned = set().union(*map(word_ngrams, first[:2]))
    assert all(not (word_ngrams(p) & banned) for p in prompts)
    assert report.kept_overlap == {"bench": 0}
    path = write_prompts_file(tmp_path / "p.jsonl", prompts)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["messages"][0]["content"] for line in lines] == prompts
