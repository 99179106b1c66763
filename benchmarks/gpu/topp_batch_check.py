"""Whether vLLM's Triton top-p keeps the same tokens for a row whatever the
number of rows beside it (issue 26, item 5: the seeded tree sample that
differed from no speculation drew a token just past the exact nucleus).

Applies `apply_top_k_top_p_triton` (top-p 0.95, no top-k) to the same 128
rows in chunks of 1, 8, 16, 64 and 128 rows, and counts, per chunk size, the
rows whose kept tokens differ from the exact nucleus (sort, cumulative sum)
and from the 8-row chunks. Prints one line per chunk size.

    python3 benchmarks/gpu/topp_batch_check.py   # on the staged GPU host
"""
from __future__ import annotations

import torch

NUM_ROWS, VOCAB, TOP_P = 128, 4096, 0.95


def kept(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton

    out = []
    for start in range(0, logits.shape[0], chunk):
        rows = logits[start:start + chunk].clone()
        top_p = torch.full((rows.shape[0],), TOP_P, device=rows.device)
        out.append(torch.isfinite(apply_top_k_top_p_triton(rows, None, top_p)))
    return torch.cat(out)


def exact(logits: torch.Tensor) -> torch.Tensor:
    probs, order = torch.softmax(logits, -1).sort(-1, descending=True)
    keep_sorted = (probs.cumsum(-1) - probs) < TOP_P
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def main() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    # a spread like the tiny model's at temperature 0.8: nuclei of tens to hundreds
    logits = torch.randn(NUM_ROWS, VOCAB, device="cuda", generator=generator) * 2.5
    reference, by_8 = exact(logits), kept(logits, 8)
    for chunk in (1, 8, 16, 64, 128):
        mask = kept(logits, chunk)
        differ = (mask != reference).any(-1)
        extra = (mask & ~reference).sum(-1)
        print(f"chunk {chunk:3d}: rows unlike the exact nucleus {int(differ.sum()):3d}, "
              f"unlike 8-row chunks {int((mask != by_8).any(-1).sum()):3d}, "
              f"tokens kept past the nucleus max {int(extra.max())}, "
              f"nucleus sizes {int(reference.sum(-1).min())}-{int(reference.sum(-1).max())}")


if __name__ == "__main__":
    main()
