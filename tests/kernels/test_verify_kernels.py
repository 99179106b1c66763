"""Greedy/stochastic tree verification and the chain rejection sampler:
Triton kernel == PyTorch reference (torch.equal), and named input errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_specplug.verification.checks import VerificationInputError
from vllm_specplug.verification.tree_greedy import verify_tree_greedy
from vllm_specplug.verification.tree_greedy_rows import verify_tree_greedy_rows
from vllm_specplug.verification.tree_sampling import (rejection_sample_chain,
                                                      verify_tree_stochastic)

from tests.kernels.conftest import LARGE_BATCH
from tests.kernels.trees import random_tree, target_following_tree

BATCHES = [1, 7, LARGE_BATCH]
TREES = [(1, 5, 6), (2, 3, 7), (4, 4, 16)]  # (topk, depth, num_draft_tokens)


def assert_outputs_equal(a, b):
    for field in dataclasses.fields(a):
        assert torch.equal(getattr(a, field.name).cpu(), getattr(b, field.name).cpu()), field.name


def noise(batch, num, vocab_size, seed, device):
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(batch, num, generator=generator)
    exp = torch.empty(batch, vocab_size).exponential_(generator=generator)
    return uniform.to(device), exp.to(device)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("topk,depth,num_nodes", TREES + [(8, 3, 64)])
def test_greedy_kernel_equals_reference(batch, topk, depth, num_nodes, device):
    *_, tree = random_tree(batch, topk, depth, num_nodes, 111, seed=batch, device=device)
    _, argmax = target_following_tree(tree, 111, follow=0.8, seed=batch)
    ref = verify_tree_greedy(tree, argmax, backend="torch")
    assert_outputs_equal(verify_tree_greedy(tree, argmax, backend="triton"), ref)
    assert ref.num_accepted.max() > 0  # the walks really went down the tree


# Full product on the small vocabulary; the interpreter is slow on 32000, so
# there every tree runs at batch 1 and 7 and one tree at batch 64.
STOCHASTIC_CASES = (
    [(b, *t, 111, s) for b in BATCHES for t in TREES for s in (None, 3)]
    + [(b, *t, 32000, s) for b in (1, 7) for t in TREES for s in (None, 5)]
    + [(LARGE_BATCH, 4, 4, 16, 32000, 5)])


@pytest.mark.parametrize("batch,topk,depth,num_nodes,vocab_size,num_splits",
                         STOCHASTIC_CASES)
def test_stochastic_kernel_equals_reference(batch, topk, depth, num_nodes, vocab_size,
                                            num_splits, device):
    *_, tree = random_tree(batch, topk, depth, num_nodes, vocab_size, seed=batch, device=device)
    probs, _ = target_following_tree(tree, vocab_size, follow=0.7, seed=batch)
    uniform, exp = noise(batch, tree.num_nodes, vocab_size, batch, device)
    ref = verify_tree_stochastic(tree, probs, uniform, exp, backend="torch")
    out = verify_tree_stochastic(tree, probs, uniform, exp, backend="triton",
                                 num_splits=num_splits)
    assert_outputs_equal(out, ref)


def chain_inputs(batch, max_drafts, vocab_size, seed, device):
    generator = torch.Generator().manual_seed(seed)
    draft_probs = torch.rand(batch, max_drafts, vocab_size, generator=generator).pow(3)
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    draft_ids = torch.multinomial(draft_probs.view(-1, vocab_size), 1,
                                  generator=generator).view(batch, max_drafts)
    # Target close to the draft so that acceptances happen.
    target = draft_probs.new_zeros(batch, max_drafts + 1, vocab_size)
    target[:, :max_drafts] = 0.7 * draft_probs
    target += 0.3 * torch.rand(target.shape, generator=generator).pow(3)
    target /= target.sum(-1, keepdim=True)
    num_drafts = torch.randint(0, max_drafts + 1, (batch,), generator=generator)
    uniform, exp = noise(batch, max_drafts, vocab_size, seed + 1, device)
    return (draft_ids.to(device), num_drafts.to(device), draft_probs.to(device),
            target.to(device), uniform, exp)


@pytest.mark.parametrize("batch,vocab_size,num_splits", [
    (b, 111, s) for b in BATCHES for s in (None, 2)] + [
    (1, 32000, None), (7, 32000, 4), (LARGE_BATCH, 32000, 4)])
def test_chain_kernel_equals_reference(batch, vocab_size, num_splits, device):
    inputs = chain_inputs(batch, 4, vocab_size, seed=batch, device=device)
    ref = rejection_sample_chain(*inputs, backend="torch")
    out = rejection_sample_chain(*inputs, backend="triton", num_splits=num_splits)
    assert_outputs_equal(out, ref)


def test_bad_verification_input_is_named(device):
    *_, tree = random_tree(3, 2, 3, 6, 50, device=device)
    probs, argmax = target_following_tree(tree, 50, follow=0.5)
    uniform, exp = noise(3, 6, 50, 0, device)
    with pytest.raises(VerificationInputError, match=r"target_argmax has shape \[3, 5\]"):
        verify_tree_greedy(tree, argmax[:, :5])
    with pytest.raises(VerificationInputError, match=r"exp_samples has shape \[3, 49\]"):
        verify_tree_stochastic(tree, probs, uniform, exp[:, :49])
    with pytest.raises(VerificationInputError, match=r"tree.token_ids holds \d+, outside the valid range \[0, 40\)"):
        verify_tree_stochastic(tree, probs[..., :40].contiguous(), uniform, exp[:, :40])
    bad_parents = tree.parent_ids.clone()
    bad_parents[0, 2] = 4
    with pytest.raises(VerificationInputError, match=r"a parent must come earlier"):
        verify_tree_greedy(dataclasses.replace(tree, parent_ids=bad_parents), argmax)
    twins = tree.token_ids.clone()
    twins[:, 2] = twins[:, 1]  # nodes 1 and 2 are both children of the root
    with pytest.raises(VerificationInputError, match=r"siblings with the same token"):
        verify_tree_stochastic(dataclasses.replace(tree, token_ids=twins), probs, uniform, exp)
    inputs = list(chain_inputs(3, 4, 50, 0, device))
    inputs[1] = torch.tensor([1, 5, 0], device=device)
    with pytest.raises(VerificationInputError, match=r"num_draft_tokens holds 5"):
        rejection_sample_chain(*inputs)


def flat_rows(tree, argmax, counts, seed):
    """A runner's view of `tree`: trees in shuffled state slots, one logits
    row per scheduled node (`counts[b]` of them, the rest cut), tokens in
    the input ids at shuffled logits indices."""
    batch, num_nodes = tree.token_ids.shape
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randperm(batch + 3, generator=generator)[:batch]
    parents = torch.full((batch + 3, num_nodes), 5, dtype=torch.int64)  # junk in free slots
    parents[slots] = tree.parent_ids.cpu()
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(counts).cumsum(0)
    live = [(b, n) for b in range(batch) for n in range(counts[b])]
    token_rows = torch.randperm(len(live) + 4, generator=generator)[:len(live)]
    input_ids = torch.randint(0, 111, (len(live) + 4,), generator=generator, dtype=torch.int32)
    input_ids[token_rows] = torch.tensor([int(tree.token_ids[b, n]) for b, n in live],
                                         dtype=torch.int32)
    target = torch.tensor([int(argmax[b, n]) for b, n in live], dtype=torch.int64)
    # every third request's slot drafted 2 nodes fewer than it holds (the
    # batch grew between drafting and verifying): its rows past them are cut
    drafted = torch.full((batch + 3,), num_nodes, dtype=torch.int32)
    drafted[slots[::3]] = max(1, num_nodes - 2)
    return target, input_ids, token_rows, cu, parents, slots.int(), drafted


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_rows_stop_at_the_slots_drafted_nodes(backend, device):
    """A slot drafted an 8-node chain, then a 3-node one (its batch grew, so
    vLLM asked for fewer drafts); the batch shrank again and the scheduler
    verifies 8 rows, the last 5 holding the old chain's tokens. The target
    follows the new chain and then the old tokens: read as nodes, they
    would be accepted under the new chain's context. The slots' drafted
    count (`TreeSlots.num_drafted`) stops verification at node 2."""
    from vllm_specplug.integration.v2.tree_slots import TreeSlots
    from vllm_specplug.verification.tree_build import chain_tree

    slots = TreeSlots(max_num_reqs=3, num_nodes=8, device=device)
    slot = torch.tensor([1], device=device)
    old = torch.tensor([[5, 11, 12, 13, 14, 15, 16, 17]], device=device)
    new = torch.tensor([[5, 21, 22]], device=device)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    slots.store(slot, chain_tree(old, zero), True)
    slots.store(slot, chain_tree(new, zero), True)
    assert slots.num_drafted.tolist() == [8, 3, 8]
    input_ids = torch.cat([new[0], old[0, 3:]]).int()  # the rows vLLM scheduled
    argmax = torch.tensor([21, 22, 13, 14, 15, 16, 17, 9], device=device)
    args = (argmax, input_ids, torch.arange(8, device=device),
            torch.tensor([0, 8], dtype=torch.int32, device=device), slots.parents, slot)
    capped = verify_tree_greedy_rows(*args, slot_num_nodes=slots.num_drafted, backend=backend)
    assert capped.num_accepted.tolist() == [2]
    assert capped.output_token_ids[0, :3].tolist() == [21, 22, 13]  # 13: the target's bonus
    assert capped.accepted_node_ids[0].tolist() == [0, 1, 2] + [-1] * 5
    uncapped = torch.full_like(slots.num_drafted, 8)  # what the cap prevents
    stale = verify_tree_greedy_rows(*args, slot_num_nodes=uncapped, backend=backend)
    assert stale.num_accepted.tolist() == [7]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("topk,depth,num_nodes", TREES)
def test_greedy_rows_kernel_equals_reference(batch, topk, depth, num_nodes, device):
    """From the runner's flat rows, with cut trees and requests without
    drafts: the kernel equals the gather-then-verify reference, and that
    equals verifying the cut trees directly."""
    *_, tree = random_tree(batch, topk, depth, num_nodes, 111, seed=batch, device="cpu")
    _, argmax = target_following_tree(tree, 111, follow=0.8, seed=batch)
    counts = [num_nodes - (b % 3) * (b % num_nodes) // 2 if b % 4 else 1 for b in range(batch)]
    *args, drafted = [t.to(device) for t in flat_rows(tree, argmax, counts, batch)]
    ref = verify_tree_greedy_rows(*args, slot_num_nodes=drafted, backend="torch")
    buffer = torch.full((batch, num_nodes), 7, dtype=torch.int64, device=device)
    ours = verify_tree_greedy_rows(*args, accepted_node_ids=buffer, slot_num_nodes=drafted,
                                   backend="triton")
    assert_outputs_equal(ours, ref)
    assert ours.accepted_node_ids.data_ptr() == buffer.data_ptr()
    full = [b for b in range(batch)
            if counts[b] == num_nodes and int(drafted[args[-1][b]]) == num_nodes]
    direct = verify_tree_greedy(tree, argmax, backend="torch")
    for name in ("output_token_ids", "num_accepted", "accepted_node_ids"):
        assert torch.equal(getattr(ref, name)[full].cpu(), getattr(direct, name)[full])
    assert (ref.num_accepted[[b for b in range(batch) if counts[b] == 1]] == 0).all()
    assert (ref.accepted_node_ids.cpu() < torch.tensor(counts)[:, None]).all()  # cut: never
    if batch > 1:
        assert ref.num_accepted.max() > 0
