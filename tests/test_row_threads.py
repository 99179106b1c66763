"""A step's verification rows filled on several host threads
(`grammar_row_threads`, integration/row_threads.py): the rows, the nodes'
verdicts and the grammars' states are those of one thread, bit for bit, on
xgrammar's JSON-schema grammar (MT-Bench's, over a character vocabulary);
an error comes back once no thread still writes. The engine with threads
runs on the GPU (tests/gpu/test_grammar_trees_cuda.py, the `tree` engine);
its speed: docs/results/v2_schema_large_head_h200."""
from __future__ import annotations

import json
import random
import string
import threading
import time

import pytest
import torch
import xgrammar as xgr
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

from vllm_specplug.integration.grammar_trees import fill_tree_rows, token_allowed
from vllm_specplug.integration.row_threads import RowThreads, _chunks, num_row_threads
from vllm_specplug.integration.worker_rows import plan_request_rows
from vllm_specplug.proposers.base import ProposerConfigError
from vllm_specplug.proposers.eagle3 import Eagle3TreeOptions
from vllm_specplug.public_sets import MT_BENCH_JSON_SCHEMA

VOCAB = list(string.printable[:95]) + ["</s>"]  # every printable character, then a stop
EOS = len(VOCAB) - 1
TEXT = json.dumps({"topic": "Hawaii", "answer": "Beaches, volcanoes and food.",
                   "key_points": ["surf", "hike", "poke"]})
NUM_REQS, NUM_NODES = 48, 17  # 816 rows: past MIN_ROWS


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(MT_BENCH_JSON_SCHEMA))


def _requests(compiled, seed: int = 0):
    """NUM_REQS grammars, each advanced into TEXT, and a tree per request
    (4 children a level, the first on TEXT's next character, the others
    random: valid and invalid nodes, some under invalid ones)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(NUM_REQS):
        start = rng.randrange(len(TEXT) - 6)
        grammar = XgrammarGrammar(vocab_size=len(VOCAB), matcher=xgr.GrammarMatcher(compiled),
                                  ctx=compiled)
        assert grammar.accept_tokens("r", [VOCAB.index(c) for c in TEXT[:start]])
        parents, drafts, frontier = [-1], [], 0
        for depth in range(4):
            children = [VOCAB.index(TEXT[start + depth])] + rng.sample(range(EOS), 3)
            first = len(parents)
            parents += [frontier] * len(children)
            drafts += children
            frontier = first
        requests.append((grammar, drafts, parents))
    return requests


def _fill(requests, threads: RowThreads) -> tuple[torch.Tensor, list]:
    """The worker's way (integration/v2/head_grammar.py): plans here, the
    walks on `threads`, the rest here; returns the rows and, per tree,
    whether each node's token is allowed by its parent's row."""
    rows = xgr.allocate_token_bitmask(NUM_REQS * NUM_NODES, len(VOCAB))
    rows.zero_()
    plans = [plan_request_rows(grammar, f"r{i}", rows[i * NUM_NODES:(i + 1) * NUM_NODES],
                               drafts, parents)
             for i, (grammar, drafts, parents) in enumerate(requests)]
    assert all(walk is not None for walk, _ in plans)  # xgrammar: every tree walked natively
    threads.run([walk.run for walk, _ in plans], [NUM_NODES] * NUM_REQS)
    assert [finish() for _, finish in plans] == [NUM_NODES - 1] * NUM_REQS
    allowed = [[token_allowed(rows[i * NUM_NODES + parents[node]], drafts[node - 1])
              for node in range(1, NUM_NODES)] for i, (_, drafts, parents) in enumerate(requests)]
    return rows, allowed


def _fill_one_by_one(requests) -> torch.Tensor:
    """Each tree through `fill_tree_rows`, in turn (the scheduler's way)."""
    rows = xgr.allocate_token_bitmask(NUM_REQS * NUM_NODES, len(VOCAB))
    rows.zero_()
    for i, (grammar, drafts, parents) in enumerate(requests):
        view = rows[i * NUM_NODES:(i + 1) * NUM_NODES]
        fill_tree_rows(grammar, f"r{i}", drafts, parents, view,
                       lambda node, view=view, grammar=grammar: grammar.fill_bitmask(view, node))
    return rows


def test_rows_filled_on_threads_equal_one_threads_bit_for_bit(compiled):
    requests = _requests(compiled)
    states = [grammar.num_processed_tokens for grammar, _, _ in requests]
    one_rows = _fill_one_by_one(requests)
    rows, one_allowed = _fill(requests, RowThreads(1))
    assert torch.equal(rows, one_rows)
    pool = RowThreads(4)
    for _ in range(3):  # the pool's threads reused
        rows, allowed = _fill(requests, pool)
        assert torch.equal(rows, one_rows)
        assert allowed == one_allowed
    assert [grammar.num_processed_tokens for grammar, _, _ in requests] == states  # rolled back
    flat = [ok for request in one_allowed for ok in request]
    assert 0 < flat.count(False) < len(flat)  # allowed and forbidden nodes both
    pool.shutdown()


def test_a_step_under_min_rows_stays_on_the_callers_thread():
    seen = []
    pool = RowThreads(4, min_rows=100)
    pool.run([lambda: seen.append(threading.get_ident())] * 9 + [None], [10] * 9 + [0])
    assert set(seen) == {threading.get_ident()} and len(seen) == 9
    seen.clear()
    pool.run([lambda: seen.append(threading.get_ident())] * 10 + [None], [10] * 10 + [0])
    assert len(seen) == 10 and threading.get_ident() not in seen
    pool.shutdown()


def test_an_error_is_raised_once_every_task_has_ended():
    """A walk that raises: the caller sees the error only after the other
    tasks wrote their rows (none still writes after it)."""
    done = set()

    def job(i: int):
        def run() -> None:
            if i == 0:
                raise ValueError("broken grammar")
            time.sleep(0.01)
            done.add(i)
        return run

    pool = RowThreads(4, min_rows=0)  # 8 tasks of 2 walks: 0 and 1 in the first
    with pytest.raises(ValueError, match="broken grammar"):
        pool.run([job(i) for i in range(16)], [1] * 16)
    ended = set(done)
    time.sleep(0.05)
    assert done == ended == set(range(2, 16))  # the others' tasks had ended; 1 never ran
    pool.shutdown()


@pytest.mark.parametrize("num_rows, num_chunks", [([17] * 64, 8), ([1, 100, 1, 1], 8),
                                                  ([5], 4), ([3, 0, 0, 7, 2], 3)])
def test_chunks_cover_every_request_in_order(num_rows, num_chunks):
    chunks = _chunks(num_rows, num_chunks)
    assert [i for chunk in chunks for i in chunk] == list(range(len(num_rows)))
    assert all(len(chunk) for chunk in chunks) and len(chunks) <= num_chunks
    if num_rows == [17] * 64:
        assert [len(chunk) for chunk in chunks] == [8] * 8


def test_auto_by_default_as_vllms_pool_and_bad_values_name_the_field(tiny_eagle3_dir):
    assert 1 <= num_row_threads("auto") <= 8 and num_row_threads(3) == 3
    options = Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": str(tiny_eagle3_dir)})
    assert options.grammar_row_threads == "auto"  # it paid on the H200 (v2_schema_threads_h200)
    for value in (0, "many", True):
        with pytest.raises(ProposerConfigError, match=f"grammar_row_threads={value!r}"):
            Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": str(tiny_eagle3_dir),
                                                            "grammar_row_threads": value})
