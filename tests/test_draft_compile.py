"""`draft_compile` (proposers/draft_compile.py): the drafter's dense steps
through torch.compile (inductor; on this CPU its C++ backend). A random
EAGLE-3 head with grouped-query attention, and a random MTP layer, each
ingest the same positions and draft the same trees and chains with and
without it: the caches and logits agree to float32 rounding, the trees
node for node, and every step served its calls compiled (`compile_status`,
which names a step that fell back). A step whose
compiled run fails runs eagerly from then on, with the same result. On
the GPU: `benchmarks/gpu/bench_draft_compile.py` (the pass alone) and
`ROWS=compile` of `benchmarks/gpu/v2_tree_runs.sh` (engines)."""
from __future__ import annotations

import pytest
import torch

from tests.test_tree_eagle_unit import _gqa_head
from vllm_specplug.proposers.draft_compile import COMPILED_STEPS, CompiledStep, compile_status
from vllm_specplug.proposers.eagle3_head import HeadRuntime


def _runtimes(drafter: str):
    """(eager, compiled) runtimes over one random drafter (an EAGLE-3 head
    or an MTP layer), and the width of what the target hands it a row."""
    from vllm_specplug.proposers.draft_layers import MtpDraftLayer

    if drafter == "eagle3":
        head, width, vocab = _gqa_head(seed=7), 48, 50
    else:
        from tests.test_mtp_unit import random_layer

        vocab = 100  # the target's: the MTP layer drafts over its lm_head
        head, width = MtpDraftLayer(random_layer(7), torch.randn(
            vocab, 32, generator=torch.Generator().manual_seed(7))), 32
    embed = torch.nn.Embedding(vocab, 32, _weight=torch.randn(
        vocab, 32, generator=torch.Generator().manual_seed(8)))
    return HeadRuntime(head, embed), HeadRuntime(head, embed, compile_steps=True), width


@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
def test_compiled_steps_draft_what_the_eager_ones_draft(drafter):
    eager, compiled, width = _runtimes(drafter)
    generator = torch.Generator().manual_seed(9)
    lengths = {"a": 7, "b": 12}
    for req_id, n in lengths.items():
        hidden, ids = torch.randn(n, width, generator=generator), torch.randint(
            0, 50, (n,), generator=generator)
        for runtime in (eager, compiled):
            runtime.ingest(req_id, hidden, ids, torch.arange(n))
    for req_id in lengths:
        a, b = eager.cache_of(req_id), compiled.cache_of(req_id)
        for name in ("keys", "values", "last_out", "last_logits"):
            torch.testing.assert_close(getattr(b, name), getattr(a, name), atol=1e-5, rtol=1e-5)
    roots, positions = torch.tensor([3, 4]), torch.tensor([7, 12])
    for shape in ((4, 3, 8), (1, 4, 5)):  # a tree, a chain
        want = eager.draft_trees(["a", "b"], roots, positions, *shape)
        got = compiled.draft_trees(["a", "b"], roots, positions, *shape)
        assert torch.equal(got.token_ids, want.token_ids), shape
        assert torch.equal(got.parent_ids, want.parent_ids), shape
    status = compile_status(compiled.compiled_steps)
    assert set(status) == set(COMPILED_STEPS) and all(n and n > 0 for n in status.values())
    compiled.compiled_steps["finish"].compiled = None  # as a failure leaves it
    assert compile_status(compiled.compiled_steps)["finish"] is None


def test_a_step_that_fails_compiled_runs_eagerly_from_then_on():
    calls = []

    def step(x):
        calls.append(x.shape)
        return x * 2

    def broken(*_):
        raise RuntimeError("no compiler")

    compiled = CompiledStep("finish", step)
    compiled.compiled = broken
    x = torch.ones(3)
    assert torch.equal(compiled(x), x * 2) and compiled.compiled is None
    assert torch.equal(compiled(x), x * 2) and len(calls) == 2 and compiled.num_calls == 0



def test_with_graphs_the_compiled_steps_serve_captured_passes_only():
    """With CUDA graphs a compiled step runs compiled only while `serves()`
    (a capture's warm-up and capture: `PassGraphs.capturing`); an eager pass
    in service runs the eager step and compiles nothing. Each compiled
    variant is counted: a batch of 1 is one more (dynamic shapes specialise
    it), what `bench offline` reports if one is compiled in service."""

    class Layer(torch.nn.Module):
        def finish(self, x):
            return torch.nn.functional.silu(x) * 2 + 1

    capturing = [False]
    step = CompiledStep("finish", Layer().finish, serves=lambda: capturing[0])
    x = torch.randn(3, 4)
    want = torch.nn.functional.silu(x) * 2 + 1
    torch.testing.assert_close(step(x), want)  # in service, eager
    assert step.num_calls == 0 and step.num_variants() == 0
    capturing[0] = True
    torch.testing.assert_close(step(x), want)
    assert step.num_calls == 1 and step.num_variants() == 1
    step(torch.randn(5, 4))  # dynamic: the same variant
    assert step.num_variants() == 1
    step(torch.randn(1, 4))  # a size of 1: specialised
    assert step.num_variants() == 2
    capturing[0] = False
    step(torch.randn(1, 7))
    assert step.num_calls == 3 and step.num_variants() == 2
