"""Tree construction: Triton kernel == PyTorch reference, chain special case,
and clear errors for malformed input."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_specplug.verification.checks import VerificationInputError
from vllm_specplug.verification.metadata import DraftCandidates
from vllm_specplug.verification.synthetic import random_candidates
from vllm_specplug.verification.tree_build import build_draft_tree
from vllm_specplug.verification.tree_ranks import score_ranks

from tests.kernels.conftest import LARGE_BATCH
from tests.kernels.trees import random_tree

SHAPES = [  # (topk, depth, num_draft_tokens)
    (1, 5, 6), (2, 3, 7), (4, 4, 16), (8, 3, 64)]


def assert_trees_equal(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        assert (x is None and y is None) or torch.equal(x.cpu(), y.cpu()), field.name


@pytest.mark.parametrize("batch", [1, 7, LARGE_BATCH])
@pytest.mark.parametrize("topk,depth,num_nodes", SHAPES)
@pytest.mark.parametrize("vocab_size", [111, 32000])
def test_kernel_equals_reference(batch, topk, depth, num_nodes, vocab_size, device):
    candidates, roots, seq_lens, _ = random_tree(batch, topk, depth, num_nodes,
                                                 vocab_size, seed=batch + topk, device=device)
    args = (candidates, roots, seq_lens, num_nodes)
    assert_trees_equal(build_draft_tree(*args, backend="triton"),
                       build_draft_tree(*args, backend="torch"))


def test_ties_keep_the_earlier_candidate(device):
    """Equal scores (a child with log-prob 0) must still keep parents first."""
    candidates = DraftCandidates(
        token_ids=torch.tensor([[5, 6, 7, 8]], device=device),
        scores=torch.tensor([[-1.0, -1.0, -1.0, -2.0]], device=device),
        parent_ids=torch.tensor([[-1, -1, 0, 1]], device=device))
    roots, seq_lens = torch.tensor([1], device=device), torch.tensor([3], device=device)
    for backend in ("torch", "triton"):
        tree = build_draft_tree(candidates, roots, seq_lens, 3, backend=backend)
        assert tree.cand_ids.tolist() == [[-1, 0, 1]]
        tree = build_draft_tree(candidates, roots, seq_lens, 4, backend=backend)
        assert tree.parent_ids.tolist() == [[-1, 0, 0, 1]]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("topk,depth,num_nodes", [(4, 4, 16), (2, 3, 7)])
def test_the_tree_of_k_nodes_keeps_the_nodes_ranked_below_k(backend, topk, depth, num_nodes,
                                                            device):
    """`score_ranks`: from one pool, the tree of k + 1 nodes holds exactly
    the candidates of the nodes ranked below k in the full tree, and ranks
    rise from parent to child (so a path's nodes of rank < k are a prefix
    of it: what the smaller tree would have accepted)."""
    candidates, roots, seq_lens, _ = random_tree(6, topk, depth, num_nodes, 111, seed=3,
                                                 device=device)
    full = build_draft_tree(candidates, roots, seq_lens, num_nodes, backend=backend)
    ranks, cands, parents = (score_ranks(candidates.scores, full.cand_ids).cpu(),
                             full.cand_ids.cpu(), full.parent_ids.cpu())
    assert ranks[:, 0].eq(-1).all()
    assert sorted(ranks[0, 1:].tolist()) == list(range(num_nodes - 1))
    child = torch.arange(1, num_nodes)
    assert (ranks[:, 1:] > ranks.gather(1, parents[:, 1:].clamp(min=0))).all()
    for k in range(1, num_nodes - 1):
        small = build_draft_tree(candidates, roots, seq_lens, k + 1, backend=backend)
        for b in range(6):
            kept = {int(c) for c, r in zip(cands[b, child], ranks[b, child]) if r < k}
            assert set(small.cand_ids[b, 1:].tolist()) == kept, (k, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_topk_one_is_a_chain(backend, device):
    candidates, roots, seq_lens, _ = random_tree(5, 1, 6, 7, 111, device=device)
    tree = build_draft_tree(candidates, roots, seq_lens, 7, backend=backend)
    chain = torch.arange(7, device=device)
    assert torch.equal(tree.parent_ids, (chain - 1).expand(5, -1))
    assert torch.equal(tree.depths, chain.expand(5, -1))
    assert torch.equal(tree.positions, seq_lens[:, None] + chain)
    lower = torch.tril(torch.ones(7, 7, dtype=torch.bool, device=device))
    assert torch.equal(tree.attn_mask, lower.expand(5, -1, -1))
    assert torch.equal(tree.token_ids[:, 1:], candidates.token_ids[:, :6])


def _bad(device, **changes):
    candidates = random_candidates(3, 2, 3, 50, device=device)
    args = dict(candidates=candidates, root_token_ids=torch.zeros(3, dtype=torch.long, device=device),
                seq_lens=torch.zeros(3, dtype=torch.long, device=device),
                num_draft_tokens=6, vocab_size=50)
    for key, value in changes.items():
        if key.startswith("cand_"):
            args["candidates"] = dataclasses.replace(candidates, **{key[5:]: value})
        else:
            args[key] = value
    return args


@pytest.mark.parametrize("change,message", [
    (lambda d: {"seq_lens": torch.zeros(4, dtype=torch.long, device=d)}, r"seq_lens has shape \[4\]"),
    (lambda d: {"cand_token_ids": torch.zeros(3, 9, dtype=torch.long, device=d)},
     r"candidates.scores has shape \[3, 10\], expected \[3, 9\]"),
    (lambda d: {"cand_parent_ids": torch.tensor([[-1, -1, 5, 0, 1, 1, 2, 2, 3, 3]] * 3, device=d)},
     r"candidates.parent_ids\[0, 2\] = 5: a parent must come earlier"),
    (lambda d: {"root_token_ids": torch.tensor([0, 50, 1], device=d)},
     r"root_token_ids holds 50, outside the valid range \[0, 50\)"),
    (lambda d: {"num_draft_tokens": 12}, r"num_draft_tokens=12 must be in \[2, 11\]"),
    (lambda d: {"cand_scores": torch.zeros(3, 10, device=d).index_fill_(1, torch.tensor([4], device=d), 1.0)},
     r"candidates.scores\[0, 4\] exceeds its parent's score"),
    (lambda d: {"seq_lens": torch.zeros(3, dtype=torch.int32, device=d)}, r"seq_lens has dtype torch.int32"),
])
def test_bad_input_is_named(change, message, device):
    with pytest.raises(VerificationInputError, match=message):
        build_draft_tree(**_bad(device, **change(device)))


@pytest.mark.parametrize("num_nodes", [1, 2, 6, 16, 33, 64])
def test_vectorized_tree_layout_equals_the_node_loop(num_nodes):
    """`tree_from_parents` (the engine's per-step tree, built on the host)
    computes depths, ancestor masks and child/sibling links without a loop
    over nodes; the reference loops (`_ancestry`, `_links`) must agree on
    random trees, chains and stars."""
    from vllm_specplug.verification import tree_build

    generator = torch.Generator().manual_seed(num_nodes)
    random = torch.full((5, num_nodes), -1, dtype=torch.long)
    for i in range(1, num_nodes):  # parents precede children
        random[:, i] = torch.randint(0, i, (5,), generator=generator)
    chain = torch.arange(-1, num_nodes - 1).expand(2, num_nodes)
    star = torch.zeros(1, num_nodes, dtype=torch.long)
    star[:, 0] = -1
    for parents in (random, chain, star):
        for fast, loop in ((tree_build._ancestry_closure, tree_build._ancestry),
                           (tree_build._links_vectorized, tree_build._links)):
            for got, want in zip(fast(parents), loop(parents)):
                assert torch.equal(got, want)


def test_ancestor_mask_is_the_root_path():
    """The shared specification (tree_masks.ancestor_mask) against the
    definition: j is allowed for i when walking parents from i reaches j."""
    import numpy as np

    from vllm_specplug.verification.tree_masks import ancestor_mask

    rng = np.random.default_rng(1)
    trees = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, 40)]
                      for _ in range(6)])
    mask = ancestor_mask(trees)
    for t, parents in enumerate(trees):
        for i in range(len(parents)):
            path, node = set(), i
            while node >= 0:
                path.add(node)
                node = parents[node]
            assert set(np.flatnonzero(mask[t, i])) == path


@pytest.mark.parametrize("topk,depth", [(1, 3), (3, 1), (4, 4)])
def test_pooling_step_by_step_equals_pooling_all_steps(topk, depth):
    """`extend_draft_pool` (what a drafting pass calls once a step) pools the
    same candidates, scores and parents as `flatten_draft_steps` over every
    step at once, at every step of an EAGLE-2 loop."""
    from vllm_specplug.verification.metadata import ROOT_PARENT
    from vllm_specplug.verification.synthetic import random_topk
    from vllm_specplug.verification.tree_build import (extend_draft_pool, flatten_draft_steps,
                                                       next_beam)

    generator = torch.Generator().manual_seed(topk * 10 + depth)
    tokens, logprobs, beams, pool = [], [], [], None
    beam = torch.full((3, 1), ROOT_PARENT, dtype=torch.long)
    for _ in range(depth):
        step_tokens, step_logprobs = random_topk(3, beam.shape[1], topk, 50, generator)
        tokens.append(step_tokens)
        logprobs.append(step_logprobs)
        beams.append(beam)
        offset = 0 if pool is None else pool.scores.shape[1]
        pool = extend_draft_pool(pool, step_tokens, step_logprobs, beam)
        want = flatten_draft_steps(tokens, logprobs, beams)
        for name in ("token_ids", "scores", "parent_ids"):
            assert torch.equal(getattr(pool, name), getattr(want, name)), name
        beam = next_beam(pool.scores[:, offset:], offset, topk)
