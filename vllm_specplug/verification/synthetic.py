"""Random but well-formed draft outputs, for tests and kernel benchmarks.

Simulates an EAGLE-2 draft loop (arXiv 2406.16858): step 0 expands the root
into top-k, each later step expands the current beam of k nodes into k*k
children and keeps the best k by path score.
"""
from __future__ import annotations

import torch

from vllm_specplug.verification.metadata import ROOT_PARENT, DraftCandidates
from vllm_specplug.verification.tree_build import flatten_draft_steps, next_beam


def random_topk(batch: int, rows: int, topk: int, vocab_size: int,
                generator: torch.Generator, device="cpu"):
    """[B, rows, topk] distinct tokens per row and their sorted log-probs."""
    logits = torch.randn(batch * rows, vocab_size, generator=generator) * 3
    logprobs, tokens = logits.log_softmax(-1).topk(topk, dim=-1)
    shape = (batch, rows, topk)
    return tokens.view(shape).to(device), logprobs.view(shape).to(device)


def random_candidates(batch: int, topk: int, depth: int, vocab_size: int,
                      seed: int = 0, device="cpu") -> DraftCandidates:
    """Pooled candidates of a `depth`-step EAGLE-2 draft with branching `topk`."""
    generator = torch.Generator().manual_seed(seed)
    tokens, logprobs, beams = [], [], []
    beam = torch.full((batch, 1), ROOT_PARENT, dtype=torch.long, device=device)
    offset = 0
    for _ in range(depth):
        step_tokens, step_logprobs = random_topk(batch, beam.shape[1], topk,
                                                 vocab_size, generator, device)
        tokens.append(step_tokens)
        logprobs.append(step_logprobs)
        beams.append(beam)
        pooled = flatten_draft_steps(tokens, logprobs, beams)
        step_scores = pooled.scores[:, offset:]
        beam = next_beam(step_scores, offset, topk)
        offset = pooled.scores.shape[1]
    return pooled


def candidate_count(topk: int, depth: int) -> int:
    return topk + (depth - 1) * topk * topk
