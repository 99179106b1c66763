"""`grammar_verify: "choices"` (and "auto") on Model Runner V2's worker, on CPU
(integration/grammar_choices.py): a greedy batch's constrained tree goes
unmasked and is planned instead of filled (the worker-rows stand-in of
tests/test_worker_rows.py), any other batch keeps its rows; then the
sampler's draws corrected on each planned request's accepted path give the
walk every node's row would give (the trees and grammar of
tests/test_grammar_greedy.py), and nothing else changes. The engine runs on
the GPU: tests/gpu/test_grammar_trees_cuda.py."""
from __future__ import annotations

import random
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.integration.grammar_choices import GrammarChoices
from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
from vllm_specplug.verification.tree_greedy import follow_choices

from tests.test_grammar_greedy import (VOCAB, _grammar, _random_case, _reference, _row,
                                       compiled)
from tests.test_grammar_trees_async import K
from tests.test_worker_rows import WORKER_DRAFT_CHARS, WORKER_PARENTS, _speculator, tokens

__all__ = ["compiled", "tokens"]  # fixtures


def _sampler(temperatures: list[float]):
    """What `greedy_tree_batch` reads of vLLM's sampler (no logprobs, no
    processors, vLLM's defaults but for the temperature)."""
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    n = len(temperatures)
    array = lambda value: SimpleNamespace(np=np.full(n, value))  # noqa: E731
    states = SimpleNamespace(temperature=SimpleNamespace(np=np.array(temperatures)),
                             min_p=array(0.0), top_k=array(len(VOCAB)), top_p=array(1.0),
                             vocab_size=len(VOCAB), max_num_logprobs=lambda idx: NO_LOGPROBS)
    return SimpleNamespace(sampling_states=states, needs_logits_processing=np.zeros(n, bool),
                           return_sampling_mask=False, trace_replay_state=None)


def _choosing(tiny_model_dir, tokens, temperatures, min_trees: int = 1):
    speculator, runner = _speculator(tiny_model_dir, tokens)
    speculator.grammar_choices = SpecplugV2HeadSpeculator.choices_for(speculator.structured)
    speculator.choices_min_trees = min_trees
    speculator._plan_choices = MethodType(SpecplugV2HeadSpeculator._plan_choices, speculator)
    runner.sampler, runner.batch_sharder = _sampler(temperatures), None
    runner.execute_model_state.input_batch.num_draft_tokens = 2 * K
    return speculator, runner


def test_a_greedy_batchs_tree_is_planned_not_filled(tiny_model_dir, tokens):
    speculator, runner = _choosing(tiny_model_dir, tokens, [0.0, 0.0])
    assert speculator.verification_rows(runner, None) is None  # no row for anyone
    planned = speculator.grammar_choices.planned["tree"]
    assert planned.token_ids == [0] + [tokens[c] for c in WORKER_DRAFT_CHARS][:K]
    assert planned.parents == WORKER_PARENTS[:K + 1]
    assert planned.grammar.num_processed_tokens == 1  # advanced to the output, "b"


@pytest.mark.parametrize("min_trees, planned", [(1, True), (2, False)])
def test_auto_plans_a_step_from_its_fewest_trees_on(tiny_model_dir, tokens, min_trees,
                                                    planned):
    """`grammar_verify: "auto"`: the step's one constrained tree is planned
    from `grammar_choices_min_trees` 1, and keeps its rows from 2."""
    speculator, runner = _choosing(tiny_model_dir, tokens, [0.0, 0.0], min_trees)
    grammar_output = speculator.verification_rows(runner, None)
    assert bool(speculator.grammar_choices.planned) == planned
    assert speculator.grammar_choices.num_steps_with_rows == (not planned)
    assert (grammar_output is None) == planned
    if not planned:
        assert grammar_output.structured_output_request_ids == ["tree"]


@pytest.mark.parametrize("temperatures", [[0.0, 0.7], [0.7, 0.0]])
def test_a_batch_that_samples_keeps_its_rows(tiny_model_dir, tokens, temperatures):
    speculator, runner = _choosing(tiny_model_dir, tokens, temperatures)
    grammar_output = speculator.verification_rows(runner, None)
    assert grammar_output.structured_output_request_ids == ["tree"]
    assert not speculator.grammar_choices.planned


def _walk(draws: list[int], tokens: list[int], parents: list[int]):
    """The tree sampler's greedy walk over one request's draws."""
    return follow_choices(parents, tokens, draws.__getitem__)


def test_corrected_draws_walk_as_every_rows_would(compiled):
    """Batches of a free request between two planned ones: each planned
    request's walk over its corrected draws is the rows' way's, the free
    one's draws are untouched, the grammars end where they began, and the
    tokens handed to the drafting pass (`take_emitted`) are the ones that
    walk emits, once."""
    rng = random.Random(7)
    counts = np.zeros(3, dtype=np.int64)
    for _ in range(30):
        choices = GrammarChoices(top_k=3)
        cases = [_random_case(rng, compiled, rng.randrange(2, 12)) for _ in range(3)]
        grammars = [_grammar(compiled, prefix) for prefix, *_ in cases]
        befores = [(g.num_processed_tokens, _row(g).tobytes()) for g in grammars]
        for i in (0, 2):
            _, parents, tree_tokens, _ = cases[i]
            choices.plan(f"r{i}", grammars[i], tree_tokens[1:], parents, len(parents))
        logits = torch.cat([case[3] for case in cases])
        sizes = [len(case[1]) for case in cases]
        batch = SimpleNamespace(req_ids=["r0", "r1", "r2"], num_reqs=3,
                                cu_num_logits_np=np.cumsum([0] + sizes))
        draws = logits.argmax(-1)
        argmax = draws.clone()
        choices.correct(logits, draws, batch)
        emitted = choices.take_emitted()
        assert sorted(emitted) == ["r0", "r2"] and not choices.take_emitted()
        for i, (prefix, parents, tree_tokens, case_logits) in enumerate(cases):
            own = draws[batch.cu_num_logits_np[i]:batch.cu_num_logits_np[i + 1]].tolist()
            if i == 1:
                assert own == argmax[batch.cu_num_logits_np[1]:batch.cu_num_logits_np[2]].tolist()
                continue
            assert _walk(own, tree_tokens, parents) == _reference(
                compiled, prefix, parents, tree_tokens, case_logits)
            assert emitted[f"r{i}"] == _walk(own, tree_tokens, parents)[1]
            assert (grammars[i].num_processed_tokens, _row(grammars[i]).tobytes()) == befores[i]
        counts += choices.counts
    assert counts[0] == 60 and counts[1] > 0 and counts[2] > 0, counts
    assert not choices.planned  # a plan serves one sampling


def test_a_node_the_grammar_cut_is_returned_as_its_logits_row(compiled):
    """`GrammarPath.cut_node_ids` of a planned request come back as logits
    rows (the second request's node 2: row 3 + 2), for the samplers to mark
    not acceptable."""
    from tests.test_grammar_greedy import _Refusing

    a, w = VOCAB.index("a"), VOCAB.index("w")
    logits = torch.zeros(6, len(VOCAB))
    logits[3, a], logits[4, w] = 5.0, 5.0
    choices = GrammarChoices(top_k=2)
    choices.plan("r1", _Refusing(_grammar(compiled, '{"topic": "H'), w), [a, w], [-1, 0, 1], 3)
    draws = logits.argmax(-1)
    batch = SimpleNamespace(req_ids=["r0", "r1"], num_reqs=2, cu_num_logits_np=np.array([0, 3, 6]))
    assert choices.correct(logits, draws, batch) == [5]
    assert not choices.take_emitted()  # a cut path: its output is read, not taken from here


def test_cut_rows_become_drafts_no_walk_accepts():
    """Model Runner V2: the rows join `invalid_drafts` (read as token -1 by
    the walk); the V1 runner: the tree's node tokens there become -1."""
    from vllm_specplug.integration.v1.tree_sampler import _cut_nodes
    from vllm_specplug.integration.v2.tree_sampler import with_rows_invalid

    logits = torch.zeros(5, 4)
    assert with_rows_invalid(None, [], logits) is None
    assert with_rows_invalid(None, [1, 3], logits).tolist() == [False, True, False, True, False]
    theirs = torch.tensor([True, False, False, False, False])
    assert with_rows_invalid(theirs, [2], logits).tolist() == [True, False, True, False, False]
    tree = SimpleNamespace(token_ids=torch.tensor([[0, 7, 8], [0, 9, 0]]))
    _cut_nodes(tree, torch.tensor([[0, 1, 2], [3, 4, -1]]), [2, 4])
    assert tree.token_ids.tolist() == [[0, 7, -1], [0, -1, 0]]
