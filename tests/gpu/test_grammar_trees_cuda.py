"""Draft trees under structured outputs on Model Runner V2 (issue 30).

With async scheduling a step's drafts reach the scheduler after the step was
scheduled; `SpecplugTreeAsyncScheduler` (the default for our tree methods
there) checks each node in the grammar state of its own path and masks its
row there, or leaves that to the worker, which fills the rows from its own
grammar (`grammar_rows: "worker"`), and the tree sampler walks
the trees over those rows. Before it,
every batch with a grammar sampled its roots only: exact, without a single
accepted draft. These tests fail on that: they ask for output equal to no
speculation's under the constraint, valid under it, and accepted drafts.

Run on the staged GPU host (docs/gpu.md) with the tiny model and its head in
`$SPECPLUG_GPU_WORK`. CI has no GPU: skipped there, with the reason.
"""
from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from vllm_specplug.testing.constraints import JSON_SCHEMA, constrained_runs, constraint
from vllm_specplug.testing.constraints import OUTPUT_PATTERNS as PATTERNS

from tests.gpu.test_model_runner_v2 import _engine, prompts, work  # noqa: F401

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (Model Runner V2 runs on CUDA only); run on the staged GPU "
           "host as docs/gpu.md says")

# masked drafts asked for: off by default on Model Runner V2 (proposers/eagle3.py)
TREE = {"method": "specplug_eagle3", "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
        "draft_temperature": 0.25, "grammar_drafts": True}
# the verification rows filled in the worker (integration/worker_rows.py),
# xgrammar's walks on host threads past row_threads.MIN_ROWS (a batch of
# NUM_PROMPTS trees has 204 rows; one request alone stays on one thread)
WORKER_ROWS = {"grammar_rows": "worker", "grammar_row_threads": "auto"}
# Drafts masked per node on their path's grammar (integration/v2/structured.py)
# and pruned by the scheduler: on the V1 runner tree 16 made 4.20 tokens a
# step masked and 2.43 unmasked on the same schema, and Model Runner V2
# unmasked 2.89 at batch 1 (docs/results/v2_grammar_trees_h100); a bound
# above what unmasked drafts gave (set before its first GPU run)
MIN_TOKENS_PER_STEP_UNDER_SCHEMA = 3.0
# grammar_drafts "first": the root's children masked inside the graphed pass
# (integration/v2/root_masks.py); on the V1 runner the same tree made 3.28
# tokens a step so, 2.43 unmasked (tests/test_tree_eagle_engine.py); a bound
# above Model Runner V2's unmasked 2.89 (set before its first GPU run)
MIN_TOKENS_PER_STEP_FIRST_STEP_MASKS = 3.0
NUM_PROMPTS = 12
NUM_ALONE = 4
MAX_TOKENS = 64
MIXED_TOKENS = 32


def _runs(llm, prompts, logprobs: int | None = None) -> dict:  # noqa: F811
    """Greedy outputs under the JSON schema (batched and alone) and, for each
    other constraint, a batch whose odd requests carry it: {kind: outputs}."""
    return constrained_runs(llm, prompts, logprobs, max_tokens=MAX_TOKENS,
                            mixed_tokens=MIXED_TOKENS, num_alone=NUM_ALONE)


def _sampled(llm, prompts) -> list:
    """Seeded samples under the JSON schema (temperature 0.8): stochastic
    verification over the trees' per-node rows."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS,
                            structured_outputs=constraint("json"))
    return llm.generate(prompts, params, use_tqdm=False)


def _assert_schema_holds(texts: list[str]) -> None:
    for text in texts:
        if text.rstrip().endswith("}"):  # finished within the token budget
            assert set(json.loads(text)) == set(JSON_SCHEMA["required"]), text
        else:
            assert text.lstrip().startswith("{"), text


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def grammar_prompts(prompts):  # noqa: F811
    return prompts[:NUM_PROMPTS]


@pytest.fixture(scope="module")
def plain(work, grammar_prompts):  # noqa: F811
    """No speculation, with each token's top-2 gap under the constraint
    (logprobs of the masked logits)."""
    from vllm_specplug.engine import shutdown_llm

    llm = _engine(work, None, dtype="float32")
    try:
        return _runs(llm, grammar_prompts, logprobs=2)
    finally:
        shutdown_llm(llm)


def _head(work):  # noqa: F811
    head = work / "tiny-eagle3"
    if not (head / "model.safetensors").exists():
        pytest.skip(f"{head} missing: run bench_tree_cuda.py prepare")
    return head


@pytest.fixture(scope="module")
def tree(work, grammar_prompts):  # noqa: F811
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    head = _head(work)
    llm = _engine(work, {**TREE, **WORKER_ROWS, "model": str(head)}, dtype="float32")
    try:
        before = read_spec_decode_counts(llm)
        runs = _runs(llm, grammar_prompts)
        counts = read_spec_decode_counts(llm) - before
        sampled = _sampled(llm, grammar_prompts)
        scheduler = llm.llm_engine.vllm_config.scheduler_config
        return {"runs": runs, "counts": counts, "sampled": sampled,
                "sampled_counts": read_spec_decode_counts(llm) - before - counts,
                "stats": llm.collective_rpc("specplug_speculator_stats")[0],
                "scheduler": (scheduler.async_scheduling, scheduler.scheduler_cls),
                "runner": llm.collective_rpc("specplug_runner_state")[0]}
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def tree_lookup(work, grammar_prompts):  # noqa: F811
    """Tree 16 grafting prompt lookups (proposers/lookup.py) onto its trees,
    under the grammars too: each grafted node is checked on its own path."""
    from vllm_specplug.engine import shutdown_llm

    llm = _engine(work, {**TREE, **WORKER_ROWS, "prompt_lookup_min": 3,
                         "model": str(_head(work))}, dtype="float32")
    try:
        return _runs(llm, grammar_prompts)
    finally:
        shutdown_llm(llm)


def _assert_exact(expected, actual, kind: str) -> None:
    """Token for token, except flips of the baseline's own fp32 near-ties
    in a batch (as for every method on the GPU, test_model_runner_v2). A
    failure names the constraint, both tokens and the baseline's logprobs
    there (the actual token absent from them: not in the baseline's top 2)."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences, top2_gaps

    found = divergences(_tokens(expected), _tokens(actual), top2_gaps(expected))
    for d in found:
        i, at = d["request"], d["position"]
        d["expected"] = expected[i].outputs[0].token_ids[at:at + 3]
        d["actual"] = actual[i].outputs[0].token_ids[at:at + 3]
        logprobs = expected[i].outputs[0].logprobs or []
        if at < len(logprobs):  # past the baseline's end: one output is a prefix
            d["baseline_logprobs"] = {t: round(lp.logprob, 4) for t, lp in logprobs[at].items()}
    # a str message: pytest shortens the repr of any other (the tokens were cut off)
    assert all(d["gap"] < NEAR_TIE_GAP for d in found) and len(found) <= 2, f"{kind}: {found}"


def test_trees_run_on_model_runner_v2_with_the_grammar_aware_scheduler(tree):
    assert tree["runner"]["speculator"] == "SpecplugV2HeadSpeculator", tree["runner"]
    assert tree["scheduler"] == (
        True, "vllm_specplug.integration.scheduler.SpecplugTreeAsyncScheduler")


def test_json_schema_outputs_equal_no_speculation_and_drafts_are_accepted(tree, plain):
    """Under the schema: token for token alone, batched too but for a
    near-tie flip; the schema holds; and a step emits more than two tokens
    on average over every constrained batch, where roots only emit one."""
    runs, counts = tree["runs"], tree["counts"]
    assert _tokens(runs["json-alone"]) == _tokens(plain["json-alone"])
    _assert_exact(plain["json"], runs["json"], "json")
    _assert_schema_holds(_texts(runs["json"]))
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0, counts
    num_tokens = sum(len(ids) for outputs in runs.values() for ids in _tokens(outputs))
    steps = num_tokens - counts.num_accepted_tokens
    assert num_tokens / steps > MIN_TOKENS_PER_STEP_UNDER_SCHEMA, (num_tokens, counts)


def test_trees_with_prompt_lookups_under_grammars_equal_no_speculation(tree_lookup, plain):
    """Lookups grafted under the JSON schema and under each other constraint
    mixed with free requests: outputs as without speculation (on the V1
    runner: tests/test_tree_eagle_engine.py's schema test, the 64-node tree)."""
    assert _tokens(tree_lookup["json-alone"]) == _tokens(plain["json-alone"])
    for kind, outputs in tree_lookup.items():
        _assert_exact(plain[kind], outputs, kind)
    _assert_schema_holds(_texts(tree_lookup["json"]))


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_constrained_and_free_requests_in_one_batch_equal_no_speculation(tree, plain, kind):
    """A regex, a choice and an EBNF grammar on every other request of one
    batch beside free ones: equal to no speculation (near-tie flips aside),
    and valid under the constraint."""
    ours = tree["runs"][kind]
    _assert_exact(plain[kind], ours, kind)
    texts = _texts(ours)[1::2]
    assert all(re.fullmatch(PATTERNS[kind], text) for text in texts), texts


def test_sampled_outputs_hold_the_schema_with_drafts_accepted(tree):
    """Stochastic verification under the schema: every sample holds it (a
    node's row from another path's state would let a forbidden token
    through), and drafts are accepted."""
    _assert_schema_holds(_texts(tree["sampled"]))
    counts = tree["sampled_counts"]
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0, counts


@pytest.fixture(scope="module")
def tree_one_size_per_step(work, grammar_prompts):  # noqa: F811
    """Our tree with one size per step (`"adaptive": true`), its drafts
    unmasked and its rows filled in the worker from the outputs each
    drafting pass queued (`StructuredRequests.queue_outputs`): its scheduler
    is the batch policy's, which must hand the rows over as ours does."""
    from vllm_specplug.engine import shutdown_llm

    head = _head(work)
    llm = _engine(work, {**TREE, **WORKER_ROWS, "grammar_drafts": False, "model": str(head),
                         "adaptive": True}, dtype="float32")
    try:
        scheduler = llm.llm_engine.vllm_config.scheduler_config
        return {"runs": _runs(llm, grammar_prompts), "scheduler": scheduler.scheduler_cls,
                "stats": llm.collective_rpc("specplug_speculator_stats")[0]}
    finally:
        shutdown_llm(llm)


def test_one_tree_size_per_step_keeps_each_node_on_its_own_path(tree_one_size_per_step, plain):
    """Every constraint, alone and batched, equal to no speculation (near-tie
    flips aside). The CPU test of the same scheduler's deferred step
    (tests/test_grammar_trees_async.py) fails where it read trees as lists."""
    assert tree_one_size_per_step["scheduler"] == (
        "vllm_specplug.integration.batch_schedule.SpecplugBatchDraftTreeAsyncScheduler")
    runs = tree_one_size_per_step["runs"]
    assert _tokens(runs["json-alone"]) == _tokens(plain["json-alone"])
    for kind in ["json", *PATTERNS]:
        _assert_exact(plain[kind], runs[kind], kind)
    _assert_schema_holds(_texts(runs["json"]))


@pytest.fixture(scope="module")
def tree_first_step(work, grammar_prompts):  # noqa: F811
    """Our tree with only the first drafting step masked, in the graphs,
    and the verification rows the scheduler's (vLLM's deferred step: the
    other engines here fill them in the worker, the default)."""
    return _counted_runs(work, grammar_prompts, {"grammar_drafts": "first",
                                                 "grammar_rows": "scheduler"}, traced=True)


class _Lines(logging.Handler):
    """The scheduler's trace of each constrained tree (`scheduler.trace`),
    kept to name what it did with a request whose output differed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _counted_runs(work, grammar_prompts, options: dict,  # noqa: F811
                  traced: bool = False, checked: bool = False) -> dict:
    """Our tree with `options` over TREE: its runs, spec-decode counts and
    speculator stats (and with `traced`, the scheduler's trace: the engine
    core runs in this process; with `checked`, the worker's grammars checked
    against their outputs at every use, `grammar_checks`)."""
    from vllm_specplug.testing.grammar_checks import worker_grammar_checks

    if not checked:
        return _runs_counted(work, grammar_prompts, options, traced)
    with worker_grammar_checks() as checks:
        return {**_runs_counted(work, grammar_prompts, options, traced), "checks": checks}


def _runs_counted(work, grammar_prompts, options: dict, traced: bool) -> dict:  # noqa: F811
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.integration.scheduler import trace
    from vllm_specplug.metrics import read_spec_decode_counts

    llm = _engine(work, {**TREE, "model": str(_head(work)), **options}, dtype="float32")
    lines = _Lines()
    if traced:  # kept here only, not printed by the handlers above it
        trace.addHandler(lines)
        trace.setLevel(logging.DEBUG)
        trace.propagate = False
    try:
        before = read_spec_decode_counts(llm)
        runs = _runs(llm, grammar_prompts)
        return {"runs": runs, "counts": read_spec_decode_counts(llm) - before,
                "stats": llm.collective_rpc("specplug_speculator_stats")[0],
                "trace": lines.lines}
    finally:
        trace.removeHandler(lines)
        trace.setLevel(logging.NOTSET)
        trace.propagate = True
        shutdown_llm(llm)


def test_first_step_masks_in_the_graphs_are_exact_and_lift_the_tree(tree_first_step, plain):
    """Every constraint equal to no speculation (near-tie flips aside), and
    more tokens a step under the schema than unmasked drafts made."""
    runs, counts = tree_first_step["runs"], tree_first_step["counts"]
    assert _tokens(runs["json-alone"]) == _tokens(plain["json-alone"])
    for kind in ["json", *PATTERNS]:
        try:
            _assert_exact(plain[kind], runs[kind], kind)
        except AssertionError as error:  # what the scheduler did with those requests
            ids = [o.request_id for o, p in zip(runs[kind], plain[kind])
                   if o.outputs[0].token_ids != p.outputs[0].token_ids]
            lines = [line for line in tree_first_step["trace"]
                     if any(f" {i} " in line or f" {i}-" in line for i in ids)]
            raise AssertionError(f"{error}\nthe scheduler's trace of {ids}:\n"
                                 + "\n".join(lines)) from error
    _assert_schema_holds(_texts(runs["json"]))
    num_tokens = sum(len(ids) for outputs in runs.values() for ids in _tokens(outputs))
    steps = num_tokens - counts.num_accepted_tokens
    assert num_tokens / steps > MIN_TOKENS_PER_STEP_FIRST_STEP_MASKS, (num_tokens, counts)


def test_constrained_rows_are_filled_in_the_worker_with_the_drafts_they_verify(
        tree, tree_first_step):
    """`grammar_rows: "worker"` (integration/worker_rows.py):
    the scheduler named the constrained requests of the steps it did not
    defer and the worker filled their rows, knowing each one's drafts on
    nearly every step (a request whose drafts it does not know verifies its
    root only); with "scheduler" the worker filled none. The exactness of
    both is the tests above."""
    stats = tree["stats"]
    assert stats["num_worker_rows_requests"] > 0, stats
    assert stats["num_worker_rows_with_drafts"] >= 0.9 * stats["num_worker_rows_requests"], stats
    assert tree_first_step["stats"]["num_worker_rows_requests"] == 0, tree_first_step["stats"]


def test_unmasked_drafting_queues_every_output_the_workers_rows_read(tree_one_size_per_step):
    """With nothing masked in the drafting pass, each one queues a copy of
    the batch's outputs and the next step's rows read it: no request's
    output is read from the device then (a wait for the step's forward)."""
    stats = tree_one_size_per_step["stats"]
    assert stats["num_worker_rows_requests"] > 0, stats
    assert stats["num_worker_rows_device_reads"] == 0, stats


@pytest.fixture(scope="module")
def tree_choices(work, grammar_prompts):  # noqa: F811
    """Our tree as a user gets it (first-step masks, rows in the worker) with
    `grammar_verify: "choices"`: greedy batches' constrained trees go
    unmasked, their draws on each accepted path set to the masked choice
    (integration/grammar_choices.py). ("auto" from 6 trees a step, which
    switches between the choices and the rows step by step, differed from
    no speculation here on an H100, twice at the same token: Model Runner
    V2 refuses it, docs/results/v2_grammar_auto_h100.) Every worker grammar
    is checked against its output where it is used (`checked`: reads of the
    device the product does not make; the `tree` fixture runs the worker's
    rows without them)."""
    return _counted_runs(work, grammar_prompts, {**WORKER_ROWS, "grammar_drafts": "first",
                                                 "grammar_verify": "choices"}, checked=True)


def test_trees_decided_from_the_targets_choices_equal_no_speculation(tree_choices, plain):
    """Every constraint, alone and batched, equal to no speculation (near-tie
    flips aside) and valid; the trees were decided so (no row filled for
    them), the first step's masks took their emitted tokens from those
    decisions (no read of the outputs), every one of them confirmed by the
    output later, every worker grammar was in its output's state wherever
    it was used, and drafts were accepted."""
    runs, counts, stats = tree_choices["runs"], tree_choices["counts"], tree_choices["stats"]
    checks = tree_choices["checks"]
    assert checks.num_checks["verify"] > 0 and checks.num_checks["draft"] > 0, checks.num_checks
    assert checks.mismatches == [], checks.mismatches[:4]
    assert _tokens(runs["json-alone"]) == _tokens(plain["json-alone"])
    for kind in ["json", *PATTERNS]:
        _assert_exact(plain[kind], runs[kind], kind)
    _assert_schema_holds(_texts(runs["json"]))
    assert stats["num_choice_requests"] > 0, stats
    assert stats["num_known_outputs"] > 0 and stats["num_known_output_repairs"] == 0, stats
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0, counts


@pytest.fixture(scope="module")
def chain_worker_rows(work, grammar_prompts):  # noqa: F811
    """Our chain (topk 1, K=5), drafts unmasked, its rows filled in the
    worker only as deep as its drafts get accepted (`grammar_row_depth`
    "auto", the default; `RowDepth`): the trees above fill every node's."""
    from vllm_specplug.engine import shutdown_llm

    head = _head(work)
    llm = _engine(work, {"method": "specplug_eagle3", "topk": 1, "num_steps": 5,
                         "grammar_drafts": False, **WORKER_ROWS, "model": str(head)},
                  dtype="float32")
    try:
        return {"runs": _runs(llm, grammar_prompts),
                "stats": llm.collective_rpc("specplug_speculator_stats")[0]}
    finally:
        shutdown_llm(llm)


def test_a_chains_rows_as_deep_as_its_drafts_get_accepted_are_exact(chain_worker_rows, plain):
    """Every constraint, alone and batched, equal to no speculation (near-tie
    flips aside), the schema held, the rows the worker's, from queued outputs."""
    runs, stats = chain_worker_rows["runs"], chain_worker_rows["stats"]
    assert _tokens(runs["json-alone"]) == _tokens(plain["json-alone"])
    for kind in ["json", *PATTERNS]:
        _assert_exact(plain[kind], runs[kind], kind)
    _assert_schema_holds(_texts(runs["json"]))
    assert stats["num_worker_rows_requests"] > 0, stats
    assert stats["num_worker_rows_device_reads"] == 0, stats
