"""Random trees and target distributions shared by the kernel tests."""
from __future__ import annotations

import torch

from vllm_specplug.verification.synthetic import candidate_count, random_candidates
from vllm_specplug.verification.tree_build import build_draft_tree_reference


def random_tree(batch: int, topk: int, depth: int, num_nodes: int, vocab_size: int,
                seed: int = 0, device="cpu"):
    """A reference-built tree of `num_nodes` (capped by the candidate count)."""
    candidates = random_candidates(batch, topk, depth, vocab_size, seed, device)
    num_nodes = min(num_nodes, candidate_count(topk, depth) + 1)
    generator = torch.Generator().manual_seed(seed + 1)
    roots = torch.randint(0, vocab_size, (batch,), generator=generator).to(device)
    seq_lens = torch.randint(0, 50, (batch,), generator=generator).to(device)
    tree = build_draft_tree_reference(candidates, roots, seq_lens, num_nodes)
    return candidates, roots, seq_lens, tree


def target_following_tree(tree, vocab_size: int, follow: float, seed: int = 0):
    """[B, N, V] probs that put extra mass on each node's first child, so that
    walks go deep, and [B, N] argmax that follows the first child w.p. `follow`."""
    batch, num_nodes = tree.token_ids.shape
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, num_nodes, vocab_size, generator=generator)
    first = tree.first_child_ids.cpu()
    has_child = first >= 0
    child_tokens = tree.token_ids.cpu().gather(1, first.clamp(min=0))
    follow_mask = has_child & (torch.rand(batch, num_nodes, generator=generator) < follow)
    rows, nodes = follow_mask.nonzero(as_tuple=True)
    logits[rows, nodes, child_tokens[rows, nodes]] += 6.0
    argmax = logits.argmax(-1)
    return logits.softmax(-1).to(tree.token_ids.device), argmax.to(tree.token_ids.device)
