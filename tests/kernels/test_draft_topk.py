"""A drafting step's top-k with log-probabilities: the kernel equals
log_softmax + topk, over vocabularies that span several chunks, at batch
shapes the drafting pass uses."""
from __future__ import annotations

import pytest
import torch

from vllm_specplug.proposers.draft_topk import draft_topk, draft_topk_reference


@pytest.mark.parametrize("shape,k", [((3, 100), 1), ((2, 4, 5000), 4), ((5, 9000), 3),
                                     ((1, 8192), 8), ((2, 3, 64), 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_log_softmax_then_topk(device, shape, k, dtype):
    generator = torch.Generator().manual_seed(sum(shape) + k)
    # continuous values: no ties, so the order is the same in both
    logits = (torch.randn(*shape, generator=generator) * 4).to(dtype).to(device)
    for temperature in (1.0, 0.25):
        want_values, want_ids = draft_topk_reference(logits, k, temperature)
        values, ids = draft_topk(logits, k, temperature, backend="triton")
        assert values.shape == want_values.shape and values.dtype == torch.float32
        assert ids.dtype == torch.int64
        if dtype == torch.float32:
            assert torch.equal(ids, want_ids)
        else:  # bf16 rows repeat values: compare the values taken, not the ids
            torch.testing.assert_close(logits.float().gather(-1, ids) / temperature,
                                       logits.float().gather(-1, want_ids) / temperature)
        torch.testing.assert_close(values, want_values, atol=1e-5, rtol=1e-5)


def test_a_strided_row_view_is_read_as_its_rows(device):
    """The head's last logits are read per slot (`pool.last_logits[slots]`):
    a view of every other row gives the rows' own top-k."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)).to(device)
    view = logits[::2]
    values, ids = draft_topk(view, 3, backend="triton")
    want_values, want_ids = draft_topk_reference(view, 3)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("order", ["rising", "falling", "shuffled"])
@pytest.mark.parametrize("k", [20, 32])
def test_wide_top_k_in_any_order_over_chunks(device, order, k):
    """The kernel passes over a chunk only as often as it has entries above
    the running k-th best: rising rows put k new entries in every chunk,
    falling rows none after the first; each must give the reference's list."""
    vocab_size = 9000  # three chunks of 4096
    values = torch.randn(vocab_size, generator=torch.Generator().manual_seed(k)).sort().values
    if order == "falling":
        values = values.flip(0)
    elif order == "shuffled":
        values = values[torch.randperm(vocab_size, generator=torch.Generator().manual_seed(2))]
    logits = torch.stack([values, values.roll(4096)]).to(device)  # the second: best in chunk 2
    got_values, got_ids = draft_topk(logits, k, backend="triton")
    want_values, want_ids = draft_topk_reference(logits, k)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_values, want_values, atol=1e-5, rtol=1e-5)
