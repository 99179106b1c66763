"""Prompt lookups in place of a head's chain (proposers/lookup.py): which
rows take them, what they draft, the options' errors, and Model Runner V2's
merge on its host path (the kernels' path: tests/kernels/test_ngram_match.py)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from vllm_specplug.proposers.base import ProposerConfigError
from vllm_specplug.proposers.eagle3 import Eagle3TreeOptions
from vllm_specplug.proposers.lookup import DeviceLookup, graft_lookups, lookup_chains
from vllm_specplug.proposers.ngram import longest_matches
from vllm_specplug.verification.metadata import NO_NODE
from vllm_specplug.verification.tree_build import _ancestry, pack_mask


def reference(history: np.ndarray, n_min: int, n_max: int, k: int):
    """One row through the n-gram proposer's own selection: the (at most k)
    tokens after the chosen occurrence, None where nothing recurs."""
    n, end = longest_matches(history[None, :], np.array([len(history)]), n_min, n_max, k)
    draft = history[end[0] + 1:end[0] + 1 + k]
    return draft.tolist() if n[0] > 0 and len(draft) else None


def padded(histories: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, histories)) + 3
    token_ids = np.full((len(histories), width), -5, dtype=np.int64)  # junk past each end
    for row, history in enumerate(histories):
        token_ids[row, :len(history)] = history
    return token_ids, np.array([len(h) for h in histories])


def test_a_digit_loop_drafts_its_continuation():
    """The SmolLM2 request that made a batch-64 wave: `"id": "1234567890123...`."""
    digits = np.array([7, 8] + [33, 34, 35, 36, 37, 38, 39, 40, 41, 32] * 2 + [33, 34])
    drafts, lengths = lookup_chains(*padded([digits]), 3, 5, 5)
    assert lengths.tolist() == [5]
    assert drafts[0].tolist() == [35, 36, 37, 38, 39]


@pytest.mark.parametrize("n_min,n_max,k", [(3, 5, 5), (1, 3, 3), (2, 2, 7)])
def test_rows_take_the_ngram_selection_with_the_tokens_it_has(n_min, n_max, k):
    rng = np.random.default_rng(n_min * 10 + k)
    histories = [rng.integers(0, 4, size=n) for n in (1, 2, 5, 9, 30, 31, 80)]
    histories.append(np.array([1, 2, 3, 4, 1, 2, 3]))  # a match with too few tokens after it
    drafts, lengths = lookup_chains(*padded(histories), n_min, n_max, k)
    want = [reference(h, n_min, n_max, k) for h in histories]
    assert lengths.tolist() == [len(w or []) for w in want]
    assert 0 < (lengths == k).sum() < len(histories)  # rows with a whole lookup, and without
    assert lengths[-1] == min(k, 4)  # "1 2 3" recurs with 4 tokens after it: a partial lookup
    for row, draft in enumerate(want):
        if draft is not None:
            assert drafts[row, :len(draft)].tolist() == draft


def test_the_merge_replaces_only_found_rows_that_sampled():
    """V2's merge on its host path: state slots scattered, a prefill chunk
    (nothing sampled) keeps the head's chain though its history repeats."""
    k = 4
    loop = np.array([5, 6, 7, 8, 9] * 4)
    fresh = np.arange(10, 30)
    histories = [loop, fresh, loop]
    lookup = DeviceLookup(2, 4, max_num_reqs=6, max_model_len=64, k=k,
                          device=torch.device("cpu"))
    token_ids = torch.zeros(6, 64, dtype=torch.int32)
    num_tokens = torch.zeros(6, dtype=torch.int32)
    slots = torch.tensor([4, 0, 2])
    for slot, history in zip(slots.tolist(), histories):
        token_ids[slot, :len(history)] = torch.from_numpy(history)
        num_tokens[slot] = len(history)
    chains = torch.full((3, k), -1, dtype=torch.int64)
    lookup.merge(["a", "b", "c"], token_ids, slots, num_tokens,
                 torch.tensor([1, 1, 0], dtype=torch.int32), chains)
    assert chains.tolist() == [[5, 6, 7, 8], [-1] * k, [-1] * k]
    assert lookup.stats() == {"lookup_rows": 1, "lookup_nodes": k}


def test_options_name_the_field_and_the_fix():
    Eagle3TreeOptions(model="h", prompt_lookup_min=3).validate("specplug_eagle3")
    Eagle3TreeOptions(model="h", topk=4, prompt_lookup_min=3).validate("specplug_eagle3")
    cases = [({"prompt_lookup_min": -1}, "must be 0 (off) or an integer >= 1"),
             ({"prompt_lookup_min": 2.5}, "prompt_lookup_min=2.5 must be 0 (off)"),
             ({"prompt_lookup_min": 2, "prompt_lookup_max": "5"}, "prompt_lookup_max=5 must be"),
             ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_max=3 must be")]
    for fields, message in cases:
        with pytest.raises(ProposerConfigError, match=re.escape(message)):
            Eagle3TreeOptions(model="h", **fields).validate("specplug_eagle3")


def test_lookup_tokens_reach_below_a_tree_within_its_nodes():
    """`prompt_lookup_tokens`: a tree's lookup may be longer than its depth
    (at most its draft nodes); a chain's is its length."""
    tree = dict(model="h", topk=4, num_steps=4, num_draft_tokens=16, prompt_lookup_min=3)
    deep = Eagle3TreeOptions(**tree, prompt_lookup_tokens=8)
    deep.validate("specplug_eagle3")
    assert deep.lookup_num_tokens == 8
    assert Eagle3TreeOptions(**tree).lookup_num_tokens == 4
    cases = [({**tree, "prompt_lookup_tokens": 16}, "at most num_draft_tokens - 1 = 15"),
             ({**tree, "prompt_lookup_tokens": -2}, "prompt_lookup_tokens=-2 must be 0"),
             ({**tree, "prompt_lookup_min": 0, "prompt_lookup_tokens": 8},
              "prompt_lookup_tokens=8 needs prompt lookups"),
             ({**tree, "topk": 1, "num_draft_tokens": 5, "prompt_lookup_tokens": 6},
              "must equal num_steps=4 for a chain")]
    for fields, message in cases:
        with pytest.raises(ProposerConfigError, match=re.escape(message)):
            Eagle3TreeOptions(**fields).validate("specplug_eagle3")
    # the deepest node a step verifies: Model Runner V2 sizes its rows by it
    assert (deep.verified_depth, Eagle3TreeOptions(**tree).verified_depth) == (8, 4)
    assert Eagle3TreeOptions(model="h", topk=4, num_steps=4, num_draft_tokens=16,
                             prompt_lookup_min=0).verified_depth == 4


def graft_reference(tokens: list[int], parents: list[int], lookup: list[int]):
    """One tree, written plainly: follow the lookup through the nodes its
    graft keeps (a match at depth d keeps those before n - span + d + 1),
    then chain the rest into the last nodes."""
    n = len(tokens)
    span = min(n - 1, len(lookup))
    anchor, matched = 0, 0
    while matched < span:
        children = [i for i in range(1, n - span + matched + 1)
                    if parents[i] == anchor and tokens[i] == lookup[matched]]
        if not children:
            break
        anchor, matched = children[0], matched + 1
    tokens, parents = list(tokens), list(parents)
    first = n - (span - matched)
    for j, node in enumerate(range(first, n)):
        tokens[node] = lookup[matched + j]
        parents[node] = anchor if j == 0 else node - 1
    return tokens, parents, span - matched


def random_trees(rng, batch: int, n: int, vocab: int):
    parents = np.zeros((batch, n), dtype=np.int64)
    parents[:, 0] = NO_NODE
    for i in range(1, n):  # parents before children, leaning deep
        parents[:, i] = rng.integers(max(0, i - 3), i, size=batch)
    return rng.integers(0, vocab, size=(batch, n)), parents


def lookups_along(rng, tokens, parents, k: int, vocab: int) -> np.ndarray:
    """Lookups that follow a random path of each tree for a while, then part."""
    lookups = rng.integers(0, vocab, size=(len(tokens), k))
    for b in range(len(tokens)):
        node = 0
        for depth in range(rng.integers(0, k + 1)):
            children = np.flatnonzero(parents[b] == node)
            if not len(children):
                break
            node = int(rng.choice(children))
            lookups[b, depth] = tokens[b, node]
    return lookups


@pytest.mark.parametrize("n,k,vocab", [(16, 4, 3), (9, 8, 2), (6, 5, 4), (40, 6, 3)])
def test_the_graft_follows_the_tree_then_takes_its_last_nodes(n, k, vocab):
    """`graft_lookups` against the plain per-tree reference, with the depths
    and packed masks (two words at 40 nodes) recomputed from the parents."""
    rng = np.random.default_rng(n * 100 + k)
    batch = 48
    tokens, parents = random_trees(rng, batch, n, vocab)
    lookups = lookups_along(rng, tokens, parents, k, vocab)
    # whole lookups, partial ones (a tree takes what there is) and none
    lengths = np.where(rng.random(batch) < 0.6, k, rng.integers(0, k, size=batch))
    found = lengths > 0
    num_nodes = rng.integers(1, n + 1, size=batch)
    num_nodes[:4] = n
    token_t, parent_t = torch.from_numpy(tokens.copy()), torch.from_numpy(parents.copy())
    depths, mask = _ancestry(parent_t)
    depths, bits = depths.to(torch.int32), pack_mask(mask)
    grafted = graft_lookups(token_t, parent_t, torch.from_numpy(lookups),
                            torch.from_numpy(lengths), torch.from_numpy(num_nodes), depths, bits)
    for b in range(batch):
        m = int(num_nodes[b])
        want = (tokens[b, :m].tolist(), parents[b, :m].tolist(), 0)
        if found[b]:
            want = graft_reference(tokens[b, :m].tolist(), parents[b, :m].tolist(),
                                   lookups[b, :lengths[b]].tolist())
        assert token_t[b, :m].tolist() == want[0]
        assert parent_t[b, :m].tolist() == want[1]
        assert int(grafted[b]) == want[2]
        assert token_t[b, m:].tolist() == tokens[b, m:].tolist()  # past the tree: untouched
    real_depths, real_mask = _ancestry(torch.where(
        torch.arange(n)[None, :] < torch.from_numpy(num_nodes)[:, None], parent_t,
        torch.arange(n)[None, :] - 1))
    real_bits = pack_mask(real_mask)
    for b in range(batch):
        m = int(num_nodes[b])
        assert depths[b, :m].tolist() == real_depths[b, :m].tolist()
        assert bits[b, :m].tolist() == real_bits[b, :m].tolist()
    assert 0 < int((grafted > 0).sum()) < int(found.sum())  # both kinds of found row


def test_a_lookup_becomes_a_root_path_of_the_tree():
    """After the graft, the lookup's first `span` tokens are a path from the
    root, and a lookup the tree already drafts changes nothing."""
    tokens = torch.tensor([[9, 1, 2, 3, 1, 4, 5, 6]])
    parents = torch.tensor([[NO_NODE, 0, 0, 1, 3, 2, 4, 5]])
    for lookup, want_grafted in (([1, 3, 1], 0), ([1, 3, 7], 1), ([2, 4, 4], 1),
                                 ([2, 4, 6], 0), ([8, 8, 8], 3)):
        t, p = tokens.clone(), parents.clone()
        grafted = graft_lookups(t, p, torch.tensor([lookup]), torch.tensor([len(lookup)]))
        assert int(grafted[0]) == want_grafted
        node = 0
        for token in lookup:
            children = [i for i in range(8) if p[0, i] == node and t[0, i] == token]
            assert children, (lookup, t.tolist(), p.tolist())
            node = children[0]
        if want_grafted == 0:
            assert t.equal(tokens) and p.equal(parents)


def test_the_tree_graft_writes_the_slots_of_the_batch():
    """V2's graft on its host path: state slots scattered, only the found
    row's tree changes, its drafts and stored parents, depths, masks and
    ranks together."""
    from types import SimpleNamespace

    n, k = 6, 3
    loop, fresh = np.array([5, 6, 7, 8] * 5), np.arange(10, 30)
    lookup = DeviceLookup(2, 4, max_num_reqs=6, max_model_len=64, k=k,
                          device=torch.device("cpu"))
    token_ids = torch.zeros(6, 64, dtype=torch.int32)
    num_tokens = torch.zeros(6, dtype=torch.int32)
    slots = torch.tensor([3, 1])
    for slot, history in zip(slots.tolist(), (loop, fresh)):
        token_ids[slot, :len(history)] = torch.from_numpy(history)
        num_tokens[slot] = len(history)
    chain = torch.arange(n)
    parents = torch.tensor([NO_NODE, 0, 0, 1, 2, 3]).repeat(6, 1)
    depths0, mask = _ancestry(parents[:1])
    trees = SimpleNamespace(parents=parents.clone(), depths=depths0.int().repeat(6, 1),
                            bits=pack_mask(mask).repeat(6, 1, 1), ranks=(chain - 1).repeat(6, 1))
    drafts = torch.tensor([[5, 9, 6, 9, 9], [11, 12, 13, 14, 15]])
    lookup.graft(["a", "b"], token_ids, slots, num_tokens, torch.tensor([1, 1]), drafts,
                 trees, n)
    # slot 3 looked up [5, 6, 7]: node 1 (5) then node 3 (6) are followed, 7 grafted last
    assert drafts.tolist() == [[5, 9, 6, 9, 7], [11, 12, 13, 14, 15]]
    assert trees.parents[3].tolist() == [NO_NODE, 0, 0, 1, 2, 3]
    assert trees.depths[3].tolist() == [0, 1, 1, 2, 2, 3]
    assert trees.ranks[3].tolist() == [-1, 0, 1, 2, 3, 4]
    drafts[0, 2] = 8  # node 3 no longer matches: 6, 7 grafted under node 1
    lookup.graft(["a", "b"], token_ids, slots, num_tokens, torch.tensor([1, 1]), drafts,
                 trees, n)
    assert drafts[0].tolist() == [5, 9, 8, 6, 7]
    assert trees.parents[3].tolist() == [NO_NODE, 0, 0, 1, 1, 4]
    assert trees.depths[3].tolist() == [0, 1, 1, 2, 2, 3]
    assert trees.ranks[3].tolist() == [-1, 0, 1, 2, 4, 4]
    _, want_mask = _ancestry(trees.parents[3:4])
    assert trees.bits[3].tolist() == pack_mask(want_mask)[0].tolist()
    for name in ("parents", "depths", "bits", "ranks"):  # other slots untouched
        assert getattr(trees, name)[1].equal(getattr(trees, name)[0])
    assert lookup.stats() == {"lookup_rows": 2, "lookup_nodes": 1 + 2}
