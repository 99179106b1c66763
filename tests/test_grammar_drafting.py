"""Drafts that know the grammar (integration/grammar_drafting.py) on vLLM's
own `StructuredOutputManager`, as the V1 drafter builds it in the worker: the
tiny model's tokenizer, xgrammar and llguidance (the backends vLLM picks by
default), no engine (tests/test_tree_eagle_engine.py runs the drafter in
one). Language "abd" | "bc", one token a letter."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.integration.grammar_drafting import DraftGrammars


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(tiny_model_dir),
                                               tokenizer=str(tiny_model_dir),
                                               dtype="float32", max_model_len=256, seed=0))


WORDS = ("abd", "bc")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def allowed_after(tokenizer, text: str) -> set[int]:
    """Every token the language allows after `text`: those that extend it
    to a prefix of a word (the vocabulary has "bc" and such too), and the
    stop token after a whole word."""
    allowed = {token_id for piece, token_id in tokenizer.get_vocab().items()
               if piece and any(w.startswith(text + piece) for w in WORDS)}
    return allowed | ({tokenizer.eos_token_id} if text in WORDS else set())


def _params(backend: str):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(regex="abd|bc"))
    params.structured_outputs._backend = backend  # as vLLM's front end picks it
    return params


def _compiled(grammars: DraftGrammars, params, output: list[int]):
    for _ in range(600):  # compiled on vLLM's threads
        grammar = grammars.grammar_of("r", params, np.array(output, dtype=np.int64))
        if grammar is not None:
            return grammar
        time.sleep(0.05)
    raise AssertionError("the drafter's grammar never compiled")


def _first_step_allowed(grammars: DraftGrammars, grammar, vocab_size: int) -> set[int]:
    identity = SimpleNamespace(logits_size=vocab_size, to_target=lambda ids: ids)  # a head's layer
    masks = grammars.masks(["r"], [grammar], identity, "cpu")
    row = masks(torch.zeros(1, vocab_size), None, None, None)[0]
    return set(torch.isfinite(row).nonzero().flatten().tolist())


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_the_drafters_grammar_is_vllms_and_follows_the_output(vllm_config, tokenizer,
                                                               backend):
    """A request's first drafting step, with no output yet, may draft what
    starts a word; after the output "b", what continues it; after "bc", the
    stop token; once that is out the grammar has ended and drafts go
    unmasked (vLLM's full row)."""
    grammars = DraftGrammars(vllm_config)
    params = _params(backend)
    vocab_size = vllm_config.model_config.get_vocab_size()
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "bc"}
    _compiled(grammars, params, [])
    for text in ("", "b", "bc"):
        output = tokenizer.convert_tokens_to_ids(list(text))
        grammar = grammars.grammar_of("r", params, np.array(output, dtype=np.int64))
        assert _first_step_allowed(grammars, grammar, vocab_size) == allowed_after(
            tokenizer, text), text
    assert {ids["b"]} < allowed_after(tokenizer, "") and allowed_after(tokenizer, "b") == {ids["c"]}
    done = np.array([ids["b"], ids["c"], tokenizer.eos_token_id])
    assert grammars.grammar_of("r", params, done) is None
    assert grammars.num_masked_passes == 3
    grammars.forget("r")
    assert "r" not in grammars.tracked


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_tokens_decided_on_the_host_advance_the_grammar_until_the_output_says_otherwise(
        vllm_config, tokenizer, backend):
    """`advance_known` takes a step's tokens as the host decided them (the
    choices of grammar_choices.py) without the output; the next output
    confirms them, or the grammar is rolled back and follows the output:
    a path the host took as "a" where the output says "b" leaves the
    grammar allowing only "c" (after "b"), as if it had read the output."""
    grammars = DraftGrammars(vllm_config)
    params = _params(backend)
    vocab_size = vllm_config.model_config.get_vocab_size()
    a, b, c = (tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    _compiled(grammars, params, [])
    tracked = grammars.tracked["r"]
    assert grammars.advance_known("r", params, [b])
    assert tracked.num_accepted == 1 and tracked.unconfirmed == [b]
    grammar = tracked.holder.structured_output_request.grammar
    assert _first_step_allowed(grammars, grammar, vocab_size) == allowed_after(tokenizer, "b")
    assert not grammars.advance_known("r", params, [c])  # "b" still unconfirmed: read it
    assert grammars.grammar_of("r", params, np.array([b])) is grammar
    assert tracked.unconfirmed is None and grammars.num_known_repairs == 0
    grammars.forget("r")
    _compiled(grammars, params, [])
    tracked = grammars.tracked["r"]
    assert grammars.advance_known("r", params, [a])
    assert _first_step_allowed(grammars, grammar_of_r(grammars), vocab_size) == allowed_after(
        tokenizer, "a")
    grammar = grammars.grammar_of("r", params, np.array([b]))  # the output disagrees
    assert grammars.num_known_repairs == 1 and tracked.num_accepted == 1
    assert _first_step_allowed(grammars, grammar, vocab_size) == allowed_after(tokenizer, "b")
    # an output shorter than the host's tokens: the same repair
    assert grammars.advance_known("r", params, [c, tokenizer.eos_token_id])
    grammar = grammars.grammar_of("r", params, np.array([b, c]))
    assert grammars.num_known_repairs == 2 and tracked.num_accepted == 2
    assert _first_step_allowed(grammars, grammar, vocab_size) == allowed_after(tokenizer, "bc")
    assert grammars.num_known_advances == 3
    # past max_tokens (a tree's path is not cut there): the tokens are cut
    # as the output is, and the output past it confirms them
    grammars.forget("r")
    params.max_tokens = 1
    _compiled(grammars, params, [])
    tracked = grammars.tracked["r"]
    assert grammars.advance_known("r", params, [b, c])
    assert tracked.num_accepted == 1 and tracked.unconfirmed == [b]
    grammars.grammar_of("r", params, np.array([b, c]))
    assert grammars.num_known_repairs == 2 and tracked.unconfirmed is None


def grammar_of_r(grammars: DraftGrammars):
    return grammars.tracked["r"].holder.structured_output_request.grammar


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_walks_advances_are_kept_once_and_confirmed_by_the_output(vllm_config, tokenizer,
                                                                     backend):
    """`keep_known` takes a grammar the verification walk advanced already
    (grammar_choices.py): the drafting pass's `advance_known` of the same
    tokens then does no grammar work, and the output confirms them or
    rolls them back as for `advance_known`'s own. Refused (the walk rolls
    back): tokens still unconfirmed, or tokens past max_tokens."""
    grammars = DraftGrammars(vllm_config)
    params = _params(backend)
    vocab_size = vllm_config.model_config.get_vocab_size()
    a, b, c = (tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    _compiled(grammars, params, [])
    tracked, grammar = grammars.tracked["r"], grammar_of_r(grammars)
    assert grammar.accept_tokens("r", [b])  # what the walk did
    assert grammars.keep_known("r", params, [b], 1)
    assert not grammars.keep_known("r", params, [c], 1)  # "b" still unconfirmed
    calls = []
    accept = grammar.accept_tokens
    grammar.accept_tokens = lambda *args: calls.append(args) or accept(*args)
    assert grammars.advance_known("r", params, [b]) and not calls
    assert tracked.num_accepted == 1 and tracked.unconfirmed == [b] and not tracked.walked
    assert _first_step_allowed(grammars, grammar, vocab_size) == allowed_after(tokenizer, "b")
    assert grammars.grammar_of("r", params, np.array([b])) is grammar  # confirmed
    assert grammars.num_known_repairs == 0 and grammars.num_known_advances == 1
    del grammar.accept_tokens
    grammars.forget("r")
    _compiled(grammars, params, [])
    tracked, grammar = grammars.tracked["r"], grammar_of_r(grammars)
    assert grammar.accept_tokens("r", [a])  # the walk's "a" where the output says "b"
    assert grammars.keep_known("r", params, [a], 1)
    grammar = grammars.grammar_of("r", params, np.array([b]))
    assert grammars.num_known_repairs == 1 and tracked.num_accepted == 1
    assert _first_step_allowed(grammars, grammar, vocab_size) == allowed_after(tokenizer, "b")
    params.max_tokens = 2  # "c" then the stop token: one past it
    assert not grammars.keep_known("r", params, [c, tokenizer.eos_token_id], 2)
    assert tracked.num_accepted == 1 and tracked.unconfirmed is None
