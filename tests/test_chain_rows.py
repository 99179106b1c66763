"""Our chain's worker rows filled depth by depth over a step's requests
(`integration/chain_rows.py`) against `fill_request_rows`, the walk of one
chain at a time that they replace: on random chains under JSON schemas
(valid prefixes, invalid drafts, stop tokens that end a grammar, vLLM's -1
placeholders, too few drafts, grammars already ended), with and without
`RowDepth`'s cut, every row bit for bit, the same acceptable drafts and
every grammar back in its state."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_specplug.integration.chain_rows import ChainRows
from vllm_specplug.integration.worker_rows import fill_request_rows

K = 5
BENCH_SCHEMA = Path(__file__).resolve().parents[1] / "benchmarks" / "json_schema.json"
# one that ends soon: its stop token is a valid draft within a few tokens
SHORT_SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                           "required": ["a"], "additionalProperties": False})


def _grammar_factory(model_dir, schema: str):
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir),
                                              vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)
    return vocab_size, lambda: XgrammarGrammar(vocab_size=vocab_size,
                                               matcher=xgr.GrammarMatcher(compiled),
                                               ctx=compiled)


def _allowed(grammar, vocab_size: int) -> list[int]:
    import xgrammar as xgr

    if grammar.is_terminated():
        return []
    row = xgr.allocate_token_bitmask(1, vocab_size)
    grammar.fill_bitmask(row, 0)
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


def _case(rng, new_grammar, vocab_size: int):
    """Two grammars in the same random state (one for each way) and a
    chain: a valid prefix of 0-K drafts, then random tokens, a stop token
    now and then, rarely vLLM's -1 or too few drafts."""
    one, two = new_grammar(), new_grammar()
    for _ in range(rng.randrange(12)):
        allowed = [t for t in _allowed(one, vocab_size)
                   if t not in one.matcher.stop_token_ids]
        if not allowed:
            break
        token = rng.choice(allowed)
        assert one.accept_tokens("a", [token]) and two.accept_tokens("b", [token])
    if rng.random() < 0.05:  # already ended: left to fill_request_rows
        stop = one.matcher.stop_token_ids[0]
        if one.accept_tokens("a", [stop]):
            assert two.accept_tokens("b", [stop])
    drafts, probe = [], 0
    for _ in range(rng.randrange(K + 1)):
        allowed = _allowed(one, vocab_size)
        if not allowed:
            break
        drafts.append(rng.choice(allowed))
        one.accept_tokens("a", [drafts[-1]])
        probe += 1
    if probe:
        one.rollback(probe)
    stops = one.matcher.stop_token_ids
    while len(drafts) < K:
        drafts.append(rng.choice(stops) if rng.random() < 0.15 else rng.randrange(vocab_size))
    roll = rng.random()
    if roll < 0.04:
        drafts[rng.randrange(K)] = -1
    elif roll < 0.08:
        drafts = drafts[:K - 1]
    return one, two, drafts


def _state_row(grammar, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    row = xgr.allocate_token_bitmask(1, vocab_size)
    if grammar.is_terminated():
        row.fill_(-1)
    else:
        grammar.fill_bitmask(row, 0)
    return row


@pytest.mark.parametrize("schema", [BENCH_SCHEMA.read_text(), SHORT_SCHEMA],
                         ids=["bench-schema", "short-schema"])
@pytest.mark.parametrize("max_drafts", [None, 0, 2])
def test_batched_chain_rows_equal_each_chains_walk(tiny_model_dir, schema, max_drafts):
    import xgrammar as xgr

    vocab_size, new_grammar = _grammar_factory(tiny_model_dir, schema)
    rng = random.Random(hash((schema[:20], max_drafts)) & 0xFFFF)
    chain_rows = ChainRows(2)
    num_cases = 0
    for _ in range(4):
        cases = [_case(rng, new_grammar, vocab_size) for _ in range(16)]
        req_ids = [f"r{i}" for i in range(len(cases))]
        num_rows = [K + 1] * len(cases)
        expected = xgr.allocate_token_bitmask(sum(num_rows), vocab_size)
        got = expected.clone()
        before = [_state_row(two, vocab_size) for _, two, _ in cases]
        want = [fill_request_rows(one, req_id, expected[i * (K + 1):(i + 1) * (K + 1)], drafts,
                                  None, max_drafts)
                for i, (req_id, (one, _, drafts)) in enumerate(zip(req_ids, cases))]
        grammars = {req_id: two for req_id, (_, two, _) in zip(req_ids, cases)}
        drafts = {req_id: d for req_id, (_, _, d) in zip(req_ids, cases)}
        assert chain_rows.fill(req_ids, grammars, drafts, num_rows, got, max_drafts) == want
        for i in range(len(cases)):
            rows = slice(i * (K + 1), (i + 1) * (K + 1))
            assert torch.equal(got[rows], expected[rows]), (i, drafts[req_ids[i]])
            assert torch.equal(_state_row(cases[i][1], vocab_size), before[i])
            assert cases[i][1].num_processed_tokens == cases[i][0].num_processed_tokens
        num_cases += len(cases)
    assert chain_rows.num_batched > num_cases // 2  # most went the batched way


def test_requests_of_various_row_counts_keep_their_own_rows(tiny_model_dir):
    """Rows are laid out request after request with their own counts (a
    chain sized per request: fewer drafts scheduled)."""
    import xgrammar as xgr

    vocab_size, new_grammar = _grammar_factory(tiny_model_dir, BENCH_SCHEMA.read_text())
    rng = random.Random(3)
    cases = [_case(rng, new_grammar, vocab_size) for _ in range(6)]
    num_rows = [K + 1, 1, 3, K + 1, 2, 4]
    req_ids = [f"r{i}" for i in range(len(cases))]
    expected = xgr.allocate_token_bitmask(sum(num_rows), vocab_size)
    got = expected.clone()
    offsets = np.cumsum([0, *num_rows])
    want = [fill_request_rows(one, req_id, expected[offsets[i]:offsets[i + 1]], drafts, None)
            for i, (req_id, (one, _, drafts)) in enumerate(zip(req_ids, cases))]
    assert ChainRows(1).fill(req_ids, {r: c[1] for r, c in zip(req_ids, cases)},
                             {r: c[2] for r, c in zip(req_ids, cases)}, num_rows, got,
                             None) == want
    assert torch.equal(got, expected)
