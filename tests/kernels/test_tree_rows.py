"""Model Runner V2 tree-step rows: kernels == references, and the references
mean what the engine needs (tree positions, ancestor rows, the verified path
the drafter ingests)."""
from __future__ import annotations

import pytest
import torch

from vllm_specplug.verification.tree_attention import TreeAttentionMetadata
from vllm_specplug.verification.tree_greedy import verify_tree_greedy
from vllm_specplug.verification.tree_rows import prepare_tree_rows, verified_rows

from tests.kernels.trees import random_tree, target_following_tree

NUM_NODES = 12
NUM_SLOTS = 9


def _batch(seed: int, device):
    """A mixed step: tree decodes, a prefill chunk, a decode without drafts,
    and a tree request in a slot whose drafts are not trees; plus the slots'
    trees (drafted earlier) and the verification of every tree."""
    *_, tree = random_tree(NUM_SLOTS, 3, 4, NUM_NODES, 50, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_SLOTS, generator=generator)[:6]
    kinds = ["tree", "prefill", "tree", "plain", "tree", "tree"]
    num_query = [NUM_NODES, 7, 5, 1, NUM_NODES, NUM_NODES]  # a tree cut to 5 nodes
    num_logits = [n if k == "tree" else 1 for k, n in zip(kinds, num_query)]
    is_tree = torch.ones(NUM_SLOTS, dtype=torch.int8)
    is_tree[slots[5]] = 0  # drafted as a chain: left to the backend
    cu = torch.tensor([0, *torch.tensor(num_logits).cumsum(0).tolist()], dtype=torch.int32)
    query_start = torch.tensor([0, *torch.tensor(num_query).cumsum(0).tolist()],
                               dtype=torch.int32)
    root_positions = torch.randint(3, 40, (6,), generator=generator)
    positions = torch.cat([p + torch.arange(n) for p, n in zip(root_positions, num_query)])
    return dict(tree=tree, slots=slots, kinds=kinds, num_query=num_query, cu=cu,
                query_start=query_start, is_tree=is_tree, positions=positions.long(),
                roots=root_positions)


def _empty_rows(num_rows: int, words: int) -> TreeAttentionMetadata:
    zeros = lambda *s: torch.full(s, 7, dtype=torch.int32)  # noqa: E731 - garbage on entry
    return TreeAttentionMetadata(zeros(num_rows), zeros(num_rows), zeros(num_rows),
                                 zeros(num_rows, NUM_NODES, words))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prepare_tree_rows_kernel_equals_reference_and_meaning(seed, device):
    b = _batch(seed, device)
    tree = b["tree"]
    depths = tree.depths.to(torch.int32)
    bits = tree.packed_mask
    words = bits.shape[2]
    outs = {}
    for backend in ("torch", "triton"):
        positions = b["positions"].clone().to(device)
        rows = _empty_rows(16, words)
        rows = TreeAttentionMetadata(*(t.to(device) for t in vars(rows).values()))
        prepare_tree_rows(positions, b["query_start"].to(device), b["cu"].to(device),
                          b["slots"].to(device), 6, b["is_tree"].to(device),
                          depths.to(device), bits.to(device), rows, backend=backend)
        outs[backend] = (positions.cpu(), rows)
    (pos_ref, ref), (pos_kernel, kernel) = outs["torch"], outs["triton"]
    assert torch.equal(pos_ref, pos_kernel)
    live = ref.num_nodes.cpu() > 0
    assert torch.equal(ref.num_nodes.cpu(), kernel.num_nodes.cpu())
    for name in ("first_token", "seq_lens"):
        assert torch.equal(getattr(ref, name).cpu()[live], getattr(kernel, name).cpu()[live])
    for row in live.nonzero().flatten().tolist():
        n = int(ref.num_nodes[row])
        assert torch.equal(ref.ancestor_bits.cpu()[row, :n], kernel.ancestor_bits.cpu()[row, :n])
    # meaning: only the full and the cut tree of tree slots are rows; their
    # positions are root + depth, their bits the slot's ancestors
    assert live.tolist() == [True, False, True, False, True, False] + [False] * 10
    for row in (0, 2, 4):
        n, slot, first = b["num_query"][row], int(b["slots"][row]), int(b["query_start"][row])
        assert int(ref.num_nodes[row]) == n and int(ref.first_token[row]) == first
        assert int(ref.seq_lens[row]) == int(b["roots"][row])
        assert torch.equal(pos_ref[first:first + n], b["roots"][row] + tree.depths[slot, :n])
        assert torch.equal(ref.ancestor_bits.cpu()[row, :n], bits[slot, :n])
    untouched = torch.cat([torch.arange(int(b["query_start"][r]), int(b["query_start"][r + 1]))
                           for r in (1, 3, 5)])
    assert torch.equal(pos_ref[untouched], b["positions"][untouched])


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("trees", [True, False])
def test_verified_rows_kernel_equals_reference_and_meaning(seed, trees, device):
    """Decode rows of trees (or chains): the ingest reads root then the
    accepted path, each followed by the next accepted token, the bonus last;
    the bonus roots the next draft; padding repeats the last request."""
    b = _batch(seed, device)
    tree = b["tree"]
    decode = [0, 2, 3, 4]  # tree rows and the plain decode (its one row)
    _, argmax = target_following_tree(tree, 50, follow=0.8, seed=seed)
    verified = verify_tree_greedy(tree, argmax, backend="torch")
    num_reqs = 6
    num_nodes = torch.tensor([b["num_query"][r] if r != 1 else 1 for r in range(num_reqs)])
    accepted = torch.full((num_reqs, NUM_NODES), -1, dtype=torch.int64)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int64)
    input_ids = torch.randint(0, 50, (int(b["query_start"][-1]),), dtype=torch.int32)
    for r in range(num_reqs):
        slot, first = int(b["slots"][r]), int(b["query_start"][r])
        if b["kinds"][r] == "tree":
            n = b["num_query"][r]
            if trees:
                input_ids[first:first + n] = tree.token_ids[slot, :n].to(torch.int32)
                path = verified.accepted_node_ids[slot]
                keep = int(min(verified.num_accepted[slot], (path[path >= 0] < n).sum() - 1))
                accepted[r, :keep + 1] = path[:keep + 1]
            else:
                keep = int(torch.randint(0, n, (1,)))
                accepted[r, :keep + 1] = torch.arange(keep + 1)
            num_accepted[r] = keep
        else:
            accepted[r, 0] = 0
    num_rejected = (num_nodes - 1 - num_accepted).to(torch.int32)
    num_rejected[1] = 0
    seq_lens = (b["roots"] + torch.tensor(b["num_query"])).to(torch.int32)
    last_sampled = torch.randint(0, 50, (NUM_SLOTS,))
    batch_rows = torch.tensor(decode)
    args = [t.to(device) for t in (batch_rows, b["query_start"], seq_lens, num_rejected,
                                   b["cu"], b["slots"])]
    nodes = accepted.to(device) if trees else None
    num_padded = len(decode) + 3  # padded to a capture size: the last request repeats
    outs = [verified_rows(*args, nodes, input_ids.to(device), last_sampled.to(device), 16,
                          num_padded, backend=backend) for backend in ("torch", "triton")]
    for name in ("token_rows", "positions", "next_ids", "slots", "cuts", "root_ids",
                 "root_positions"):
        assert torch.equal(getattr(outs[0], name).cpu(), getattr(outs[1], name).cpu()), name
        per_request = getattr(outs[0], name).view(num_padded, -1).cpu()
        assert (per_request[len(decode):] == per_request[len(decode) - 1]).all(), name
    ref = outs[0]
    for p, r in enumerate(decode):
        first, a = int(b["query_start"][r]), int(num_accepted[r])
        path = accepted[r, :a + 1]
        rows = ref.token_rows.view(num_padded, 16)[p].cpu()
        assert torch.equal(rows[:a + 1], first + path) and (rows[a + 1:] == rows[a]).all()
        assert torch.equal(ref.positions[p].cpu()[:a + 1], b["roots"][r] + torch.arange(a + 1))
        following = ref.next_ids.view(num_padded, 16)[p].cpu()
        assert torch.equal(following[:a], input_ids[first + path[1:]].long())
        assert int(following[a]) == int(last_sampled[b["slots"][r]])
        assert int(ref.cuts[p]) == int(b["roots"][r])
        # the next draft's root: the bonus token, right after the accepted path
        assert int(ref.root_ids[p]) == int(last_sampled[b["slots"][r]])
        assert int(ref.root_positions[p]) == int(b["roots"][r]) + a + 1
