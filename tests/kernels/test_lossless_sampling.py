"""Losslessness of stochastic verification, checked statistically: with many
independent samples the emitted tokens follow the target distribution
(chi-square, fixed seeds, so the outcome is deterministic).

The reference implementations are used here (they are vectorised over the
batch); the kernels are held to them token for token in test_verify_kernels.
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vllm_specplug.verification.tree_sampling import (rejection_sample_chain,
                                                      verify_tree_stochastic)

from tests.kernels.trees import random_tree, target_following_tree

NUM_SAMPLES = 40_000
VOCAB = 7
P_MIN = 1e-3  # reject "matches the target" below this p-value


def repeat_tree(tree, times):
    return type(tree)(**{k: None if v is None else v.expand(times, *v.shape[1:]).contiguous()
                         for k, v in vars(tree).items()})


def chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * observed.sum()
    return chisquare(observed.numpy(), expected.numpy()).pvalue


def sample_tree(topk: int, seed: int):
    *_, tree = random_tree(1, topk, 3, 1 + 3 * topk, VOCAB, seed=seed)
    probs, _ = target_following_tree(tree, VOCAB, follow=1.0, seed=seed)
    probs = (probs + 0.02).div(1 + 0.02 * VOCAB)  # every token reachable
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(NUM_SAMPLES, tree.num_nodes, generator=generator)
    exp = torch.empty(NUM_SAMPLES, VOCAB).exponential_(generator=generator)
    many = repeat_tree(tree, NUM_SAMPLES)
    many_probs = probs.expand(NUM_SAMPLES, -1, -1).contiguous()
    return tree, probs[0], verify_tree_stochastic(many, many_probs, uniform, exp,
                                                  backend="torch"), exp


@pytest.mark.parametrize("topk", [1, 2, 4])
def test_tree_first_token_follows_target(topk):
    _, probs, out, _ = sample_tree(topk, seed=topk)
    assert chi_square_p(out.output_token_ids[:, 0], probs[0]) > P_MIN
    assert 0 < out.num_accepted.float().mean() < 3  # both outcomes occur


@pytest.mark.parametrize("topk", [1, 2, 4])
def test_tree_second_token_follows_target_at_accepted_child(topk):
    tree, probs, out, _ = sample_tree(topk, seed=10 + topk)
    child = int(tree.first_child_ids[0, 0])
    took_child = out.output_token_ids[:, 0] == tree.token_ids[0, child]
    assert took_child.sum() > 2000
    assert chi_square_p(out.output_token_ids[took_child, 1], probs[child]) > P_MIN


def test_statistic_detects_a_sampler_that_skips_the_residual():
    """Power check: sampling the fallback from p instead of the residual
    (a classic bug) must be caught by the same test at the same size."""
    tree, probs, out, exp = sample_tree(2, seed=3)
    rejected = out.num_accepted == 0
    buggy = out.output_token_ids[:, 0].clone()
    buggy[rejected] = (probs[0] / exp[rejected]).argmax(-1)
    assert chi_square_p(buggy, probs[0]) < 1e-6


def test_chain_with_draft_probs_follows_target():
    generator = torch.Generator().manual_seed(7)
    num_drafts = 2
    draft = torch.rand(num_drafts, VOCAB, generator=generator).pow(2)
    draft /= draft.sum(-1, keepdim=True)
    target = torch.rand(num_drafts + 1, VOCAB, generator=generator).pow(2)
    target /= target.sum(-1, keepdim=True)
    draft_ids = torch.stack([torch.multinomial(draft[i], NUM_SAMPLES, replacement=True,
                                               generator=generator)
                             for i in range(num_drafts)], dim=1)
    uniform = torch.rand(NUM_SAMPLES, num_drafts, generator=generator)
    exp = torch.empty(NUM_SAMPLES, VOCAB).exponential_(generator=generator)
    out = rejection_sample_chain(
        draft_ids, torch.full((NUM_SAMPLES,), num_drafts), draft.expand(NUM_SAMPLES, -1, -1),
        target.expand(NUM_SAMPLES, -1, -1).contiguous(), uniform, exp, backend="torch")
    assert chi_square_p(out.output_token_ids[:, 0], target[0]) > P_MIN
    accepted_first = out.num_accepted >= 1
    assert chi_square_p(out.output_token_ids[accepted_first, 1], target[1]) > P_MIN
