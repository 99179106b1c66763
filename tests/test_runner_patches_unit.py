"""The V1 runner's `_prepare_inputs` patch (patches/gpu_model_runner.py): a
step that verifies no draft at all samples as one without speculation for a
model-free drafter (no rejection sampler over zero drafts), and every other
step keeps vLLM's verification metadata. Engine exactness of such steps is in
the model-free engine tests (steps where no request found a draft)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_specplug.integration.v1.drafter import SpecplugDrafter
from vllm_specplug.integration.v1.hooks import V1DrafterHooks
from vllm_specplug.integration.v1.tree_drafter import TreeEagleDrafter
from vllm_specplug.patches.gpu_model_runner import _prepare_inputs

INDICES, METADATA = object(), object()  # what vLLM's own returns


class _Drafter(V1DrafterHooks):
    def __init__(self, plain: bool) -> None:
        self.plain_steps_without_drafts = plain
        self.prepared = 0

    def after_prepare_inputs(self, runner, scheduler_output) -> None:
        self.prepared += 1


def _run(drafter, spec_tokens: dict, hybrid: bool = False, metadata=METADATA):
    runner = SimpleNamespace(drafter=drafter, model_config=SimpleNamespace(is_hybrid=hybrid))
    output = SimpleNamespace(scheduled_spec_decode_tokens=spec_tokens)
    patched = _prepare_inputs(lambda self, so, n: (INDICES, metadata, 6))
    return patched(runner, output, None)


def test_a_step_without_drafts_samples_plainly_for_a_model_free_drafter():
    drafter = _Drafter(plain=True)
    assert _run(drafter, {}) == (INDICES, None, 1)
    assert drafter.prepared == 1  # the drafter's hooks still ran


@pytest.mark.parametrize("case", ["drafts", "tree drafter", "recurrent layers", "vllm's own"])
def test_every_other_step_keeps_vllms_metadata(case):
    drafter = _Drafter(plain=case != "tree drafter")
    spec = {"r0": [5, 6]} if case == "drafts" else {}
    if case == "vllm's own":
        drafter = SimpleNamespace()  # not ours: vLLM's code alone
    assert _run(drafter, spec, hybrid=case == "recurrent layers") == (INDICES, METADATA, 6)


def test_which_drafters_sample_plainly():
    """Model-free drafters read the metadata only for hidden states, which
    plain sampling gives too; tree heads read their ingest rows from it."""
    assert SpecplugDrafter.plain_steps_without_drafts
    assert not TreeEagleDrafter.plain_steps_without_drafts
