"""Property tests (hypothesis) on random trees, checked against independent
brute-force definitions rather than against the implementation's own steps."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_specplug.verification.synthetic import candidate_count
from vllm_specplug.verification.tree_greedy import (verify_chain_greedy_reference,
                                                    verify_tree_greedy)
from vllm_specplug.verification.tree_sampling import (rejection_sample_chain,
                                                      verify_tree_stochastic)

from tests.kernels.trees import random_tree, target_following_tree

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def tree_shapes(draw):
    topk = draw(st.integers(1, 4))
    depth = draw(st.integers(1, 5))
    num_nodes = draw(st.integers(2, candidate_count(topk, depth) + 1))
    return draw(st.integers(1, 5)), topk, depth, num_nodes, draw(st.integers(0, 10**6))


def ancestors(parents: list[int], node: int) -> set[int]:
    found = {node}
    while parents[node] != -1:
        node = parents[node]
        found.add(node)
    return found


@SETTINGS
@given(shape=tree_shapes())
def test_tree_structure(shape):
    batch, topk, depth, num_nodes, seed = shape
    candidates, _, seq_lens, tree = random_tree(batch, topk, depth, num_nodes, 97, seed)
    for b in range(batch):
        parents = tree.parent_ids[b].tolist()
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        for i in range(num_nodes):
            anc = ancestors(parents, i)
            assert set(tree.attn_mask[b, i].nonzero().flatten().tolist()) == anc
            assert tree.positions[b, i] == seq_lens[b] + len(anc) - 1
            packed = [int(w) & 0xFFFFFFFF for w in tree.packed_mask[b, i]]
            assert {j for j in range(num_nodes) if packed[j // 32] >> (j % 32) & 1} == anc
            children, child = [], tree.first_child_ids[b, i].item()
            while child != -1:
                children.append(child)
                child = tree.next_sibling_ids[b, child].item()
            assert children == [j for j in range(num_nodes) if parents[j] == i]
        kept = set(tree.cand_ids[b, 1:].tolist())
        dropped = [c for c in range(candidates.scores.shape[1]) if c not in kept]
        if dropped:  # the kept set is the best-scoring one
            assert min(candidates.scores[b, list(kept)]) >= max(candidates.scores[b, dropped])


@SETTINGS
@given(shape=tree_shapes(), follow=st.floats(0.0, 1.0))
def test_greedy_accepts_the_longest_matching_root_path(shape, follow):
    batch, topk, depth, num_nodes, seed = shape
    *_, tree = random_tree(batch, topk, depth, num_nodes, 97, seed)
    _, argmax = target_following_tree(tree, 97, follow, seed)
    out = verify_tree_greedy(tree, argmax, backend="torch")
    for b in range(batch):
        parents, tokens = tree.parent_ids[b].tolist(), tree.token_ids[b].tolist()
        matches = [True] + [False] * (num_nodes - 1)  # path from root all matching
        for i in range(1, num_nodes):
            matches[i] = matches[parents[i]] and tokens[i] == argmax[b, parents[i]]
        deepest = max(len(ancestors(parents, i)) - 1 for i in range(num_nodes) if matches[i])
        m = int(out.num_accepted[b])
        path = out.accepted_node_ids[b, :m + 1].tolist()
        assert m == deepest and path[0] == 0
        assert all(parents[path[k]] == path[k - 1] for k in range(1, m + 1))
        assert out.output_token_ids[b, :m].tolist() == [tokens[n] for n in path[1:]]
        assert out.output_token_ids[b, m] == argmax[b, path[-1]]
        assert (out.output_token_ids[b, m + 1:] == -1).all()


@SETTINGS
@given(batch=st.integers(1, 6), depth=st.integers(1, 6), seed=st.integers(0, 10**6),
       follow=st.floats(0.0, 1.0))
def test_topk_one_tree_equals_the_chain_algorithms(batch, depth, seed, follow):
    *_, tree = random_tree(batch, 1, depth, depth + 1, 53, seed)
    probs, argmax = target_following_tree(tree, 53, follow, seed)
    drafts = tree.token_ids[:, 1:]
    tree_greedy = verify_tree_greedy(tree, argmax, backend="torch")
    chain_greedy = verify_chain_greedy_reference(drafts, argmax)
    for name in ("output_token_ids", "num_accepted", "accepted_node_ids"):
        assert torch.equal(getattr(tree_greedy, name), getattr(chain_greedy, name)), name
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(batch, depth + 1, generator=generator)
    exp = torch.empty(batch, 53).exponential_(generator=generator)
    one_hot = torch.nn.functional.one_hot(drafts, 53).float()  # deterministic drafts
    tree_out = verify_tree_stochastic(tree, probs, uniform, exp, backend="torch")
    chain_out = rejection_sample_chain(drafts, torch.full((batch,), depth), one_hot, probs,
                                       uniform[:, 1:], exp, backend="torch")
    for name in ("output_token_ids", "num_accepted", "accepted_node_ids"):
        assert torch.equal(getattr(tree_out, name), getattr(chain_out, name)), name
