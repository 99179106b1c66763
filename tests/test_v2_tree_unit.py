"""Unit tests of the Model Runner V2 tree step's pure pieces (no engine: Model
Runner V2 needs CUDA; its engine tests are tests/gpu/test_tree_eagle_cuda.py).

KV compaction moves every accepted node to its depth on vLLM's CUDA cache
layout and nothing else; the tree slots keep what was drafted;
the head runtime's padded ingest equals its ragged ingest."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.integration.v2.tree_sampler import compact_kv
from vllm_specplug.integration.v2.tree_slots import TreeSlots
from vllm_specplug.verification.tree_greedy import verify_tree_greedy

from tests.kernels.trees import random_tree, target_following_tree


def test_compaction_moves_each_accepted_node_to_its_depth():
    """On vLLM's CUDA cache layout (logical [blocks, kv_heads, block_size,
    2 * head_size], token-major in memory), with Model Runner V2's batch
    fields: each accepted node's K and V land at root + depth, and nothing
    else changes. (A stand-in batch: Model Runner V2 needs CUDA.)"""
    *_, tree = random_tree(5, 3, 4, 10, 40, seed=4)
    _, argmax = target_following_tree(tree, 40, follow=0.9, seed=4)
    verified = verify_tree_greedy(tree, argmax, backend="torch")
    num_query = torch.tensor([10, 10, 1, 10, 4])  # a request without drafts, a cut tree
    accepted, num_accepted = verified.accepted_node_ids.clone(), verified.num_accepted.clone()
    accepted[2, 1:], num_accepted[2] = -1, 0
    cut = (accepted[4] >= 4).nonzero()
    if len(cut):  # the cut tree accepts only nodes it had
        accepted[4, int(cut[0]):] = -1
        num_accepted[4] = int(cut[0]) - 1
    roots = torch.tensor([3, 17, 8, 0, 25])
    block_size, heads, head_size = 4, 2, 3
    block_table = torch.randperm(60)[:5 * 10].view(5, 10).int()
    physical = torch.randn(60, block_size, heads, 2 * head_size)
    logical = physical.transpose(1, 2)  # what vLLM hands the backends
    before = physical.clone()
    slots = TreeSlots(8, 10, "cpu")
    slots.bind_kv_caches([logical])
    slots.block_table = block_table
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), num_query.cumsum(0)]).int()
    batch = SimpleNamespace(num_reqs=5, query_start_loc=query_start,
                            seq_lens=(roots + num_query).int())
    compact_kv(slots, batch, accepted, num_accepted)

    def row(tensor, b, position):
        block = int(block_table[b, position // block_size])
        return tensor[block, position % block_size]

    moved = set()
    for b in range(5):
        for depth in range(int(num_accepted[b]) + 1):
            node = int(accepted[b, depth])
            assert torch.equal(row(physical, b, int(roots[b]) + depth),
                               row(before, b, int(roots[b]) + node)), (b, depth)
            moved.add((int(block_table[b, (int(roots[b]) + depth) // block_size]),
                       (int(roots[b]) + depth) % block_size))
    for block in range(60):
        for offset in range(block_size):
            if (block, offset) not in moved:
                assert torch.equal(physical[block, offset], before[block, offset])


def test_tree_slots_store_and_forget():
    *_, tree = random_tree(3, 3, 4, 8, 40, seed=1)
    slots = TreeSlots(6, 8, "cpu")
    index = torch.tensor([4, 0, 2])
    slots.store(index, tree, True)
    assert torch.equal(slots.parents[index], tree.parent_ids)
    assert torch.equal(slots.depths[index], tree.depths.int())
    assert torch.equal(slots.bits[index], tree.packed_mask)
    assert slots.is_tree.tolist() == [1, 0, 1, 0, 1, 0]
    slots.forget(torch.tensor([2]))
    assert slots.is_tree.tolist() == [1, 0, 0, 0, 1, 0]
    assert slots.parents[2].tolist() == list(range(-1, 7))  # verified as a chain
    assert slots.depths[2].tolist() == list(range(8))
    # a smaller tree (a bigger batch asked for fewer drafts) fills the first nodes
    *_, small = random_tree(1, 2, 3, 5, 40, seed=2)
    slots.store(torch.tensor([4]), small, True)
    assert torch.equal(slots.parents[4, :5], small.parent_ids[0])
    assert torch.equal(slots.depths[4, :5], small.depths[0].int())
    assert torch.equal(slots.bits[4, :5], small.packed_mask[0])
    assert torch.equal(slots.parents[0], tree.parent_ids[1])  # other slots untouched


def test_accepted_paths_node_ranks_reach_the_host_a_step_late():
    """For the batch policy (integration/v2/path_ranks.py): the tree slots
    keep each stored tree's node ranks; after verification a row's
    accepted nodes read as their ranks in path order (rising; `num_nodes`
    past the path); `PathRanks` hands a step's ranks out at the next step's
    `take`, once, for the rows that verified the step's draft count."""
    from vllm_specplug.integration.v2.path_ranks import PathRanks
    from vllm_specplug.verification.metadata import NO_NODE
    from vllm_specplug.verification.tree_ranks import score_ranks

    candidates, *_, tree = random_tree(2, 4, 4, 16, 40, seed=3)
    tree.score_ranks = score_ranks(candidates.scores, tree.cand_ids)  # `HeadRuntime.rank_nodes`
    slots = TreeSlots(4, 16, "cpu")
    slots.keep_ranks()
    slots.store(torch.tensor([2, 0]), tree, True)
    leaf = int(tree.depths[0].argmax())  # row 0 (slot 2) accepts the path to its deepest node
    path = [leaf]
    while path[-1] > 0:
        path.append(int(tree.parent_ids[0, path[-1]]))
    path = path[::-1]  # root .. leaf
    slots.accepted_nodes[:] = NO_NODE
    slots.accepted_nodes[0, :len(path)] = torch.tensor(path)
    slots.accepted_nodes[1, 0] = 0  # row 1 (slot 0) accepts nothing
    ranks = slots.path_ranks(torch.tensor([2, 0]), 2)
    want = [int(tree.score_ranks[0, node]) for node in path[1:]]
    assert ranks[0].tolist() == want + [16] * (15 - len(want))
    assert want == sorted(want) and ranks[1].tolist() == [16] * 15
    slots.forget(torch.tensor([2]))
    assert slots.ranks[2].tolist() == list(range(-1, 15))  # a chain's node i: rank i - 1

    batch = SimpleNamespace(num_reqs=3, num_scheduled_tokens=np.array([16, 16, 40]),
                            is_prefilling_np=np.array([False, False, True]),
                            idx_mapping=torch.tensor([2, 0, 1]))
    slots.store(torch.tensor([2]), _first(tree), True)
    keeper = PathRanks(4, 16, torch.device("cpu"), record_every=1)
    assert keeper.due()
    keeper.record_step(batch, slots)
    assert keeper.take() is None  # the step's own ranks wait for the next step
    keeper.record_step(batch, slots)
    num_drafts, got = keeper.take()
    assert num_drafts == 15 and got.shape == (2, 15)  # the prefill row left out
    assert got[0].tolist() == ranks[0].tolist()
    assert keeper.take() is None  # taken once
    sampled = PathRanks(4, 16, torch.device("cpu"), record_every=3)  # one step in 3
    for _ in range(7):
        if sampled.due():
            sampled.record_step(batch, slots)
    assert sampled.num_recorded == 3  # steps 1, 4 and 7
    settled = PathRanks(4, 16, torch.device("cpu"), record_every=3)  # the policy settled
    assert [settled.due(sample_every=2) for _ in range(7)] == [
        True, False, False, False, False, False, True]


class _Event:
    """A CUDA event's `record` / `query`, and no `synchronize`: a read that
    waited for the GPU would fail here."""
    def __init__(self):
        self.done = False

    def record(self):
        self.done = False

    def query(self):
        return self.done


def test_path_ranks_are_read_when_their_copy_has_finished_never_waiting():
    """Under async scheduling the host launches a step while the GPU still
    runs the one before: `take` hands out the oldest record not yet read
    once its event says its copy finished, and returns None (no wait)
    while it has not; records past `NUM_BUFFERS` unread are dropped,
    counted."""
    from vllm_specplug.integration.v2.path_ranks import NUM_BUFFERS, PathRanks

    keeper = PathRanks(2, 4, torch.device("cpu"))
    keeper.events = [_Event() for _ in keeper.events]
    rows = np.array([0, 1])
    for step in range(2):
        keeper.record(torch.full((2, 3), step), 3, rows)
    assert keeper.take() is None  # the first copy has not finished: no wait
    keeper.events[0].done = True
    num_drafts, got = keeper.take()
    assert num_drafts == 3 and got.tolist() == [[0] * 3] * 2
    keeper.events[1].done = True
    assert keeper.take() is None  # the last record waits for a later step
    keeper.record(torch.full((2, 3), 2), 3, rows)
    assert keeper.take()[1].tolist() == [[1] * 3] * 2
    for step in range(3, 3 + NUM_BUFFERS):
        keeper.record(torch.full((2, 3), step), 3, rows)
    assert keeper.num_dropped == 1  # record 2 was overwritten unread
    for event in keeper.events:
        event.done = True
    assert keeper.take()[1].tolist() == [[3] * 3] * 2  # the oldest kept comes first


def _first(tree):
    """The tree of the first request alone."""
    import dataclasses

    return dataclasses.replace(tree, **{f.name: getattr(tree, f.name)[:1]
                                        for f in dataclasses.fields(tree)})


def test_padded_ingest_equals_ragged_ingest():
    """What the V2 speculator does for decoding requests (verified rows padded
    by repetition, on the device) leaves the head's cache and last output as
    the ragged ingest does."""
    from vllm_specplug.models.heads import build_head
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    head = load_head(build_head("tiny-eagle3"))
    embed = torch.nn.Embedding(head.config.vocab_size, head.config.hidden_size)
    width = head.config.target_hidden_size * len(head.config.aux_layer_ids)
    generator = torch.Generator().manual_seed(0)
    runtimes = [HeadRuntime(head, embed) for _ in range(2)]
    for runtime in runtimes:
        runtime.make_pool(4, torch.float32, "cpu")
    prefix = torch.randn(12, width, generator=generator)
    prefix_ids = torch.randint(0, 100, (12,), generator=generator)
    for runtime in runtimes:  # both cache positions 0..5 of slots 1 and 3
        runtime.ingest_slots(np.array([1, 3]), np.array([True, True]), prefix, prefix_ids,
                             np.array([0, 1, 2, 3, 4, 5] * 2), [6, 6])
    counts = [3, 1]  # slot 1 verified 3 positions, slot 3 one
    hidden = torch.randn(4, width, generator=generator)
    ids = torch.randint(0, 100, (4,), generator=generator)
    positions = np.array([6, 7, 8, 6])
    runtimes[0].ingest_slots(np.array([1, 3]), np.array([False, False]), hidden, ids,
                             positions, counts)
    take = torch.tensor([0, 1, 2, 2, 3, 3, 3, 3])  # 4 rows each, the last repeated
    runtimes[1].ingest_padded(torch.tensor([1, 3]), hidden[take], ids[take],
                              torch.from_numpy(positions)[take].view(2, 4),
                              torch.tensor([6, 6]), max_position=8)
    ragged, padded = (r.pool for r in runtimes)
    for name in ("keys", "values", "last_out", "last_logits"):
        torch.testing.assert_close(getattr(padded, name), getattr(ragged, name),
                                   atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.valid, ragged.valid)


def test_step_tree_shape_follows_the_drafts_vllm_asks_for():
    """vLLM's dynamic speculative decoding asks for fewer drafts at bigger
    batches: the tree has that many nodes past the root, at least one, at
    most the method's, and no deeper drafting than it can use."""
    from vllm_specplug.integration.v2.step_inputs import step_tree_shape

    tree, chain = (4, 4, 16), (1, 5, 6)
    assert step_tree_shape(tree, None) == tree and step_tree_shape(tree, 15) == tree
    assert step_tree_shape(tree, 40) == tree
    assert step_tree_shape(tree, 5) == (4, 4, 6)
    assert step_tree_shape(tree, 2) == (2, 2, 3)  # no wider than the nodes it keeps
    assert step_tree_shape(tree, 0) == (1, 1, 2)  # still ingests; vLLM drops the draft
    assert step_tree_shape(chain, 3) == (1, 3, 4)


def _fused_step_runtimes(seed: int, device: str = "cpu", cuda_graphs=(False, False)):
    """Two runtimes over one random GQA head, both holding slots 0-2's
    positions 0..9, and a padded decode step for them (3 requests padded
    to 4, 4 rows each: slot 2 verified 3 positions, the others 1 and 4)."""
    from tests.test_tree_eagle_unit import _gqa_head
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    head = _gqa_head(seed).to(device)
    generator = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(50, 32, _weight=torch.randn(50, 32, generator=generator))
    embed = embed.to(device)
    runtimes = [HeadRuntime(head, embed, cuda_graphs=graphs) for graphs in cuda_graphs]
    prefix = torch.randn(30, 48, generator=generator).to(device)
    prefix_ids = torch.randint(0, 50, (30,), generator=generator).to(device)
    for runtime in runtimes:
        runtime.make_pool(4, torch.float32, device)
        runtime.ingest_slots(np.array([0, 1, 2]), np.ones(3, dtype=bool), prefix, prefix_ids,
                             np.tile(np.arange(10), 3), [10, 10, 10])
    counts = torch.tensor([3, 1, 4, 4])  # the 4th request pads: it repeats the 3rd
    take = torch.minimum(torch.arange(4)[None], counts[:, None] - 1)  # [4, 4]
    step = dict(slots=torch.tensor([2, 0, 1, 1]),
                target_hidden=torch.randn(4, 4, 48, generator=generator)
                .gather(1, take[..., None].expand(-1, -1, 48)).flatten(0, 1),
                next_token_ids=torch.randint(0, 50, (4, 4), generator=generator)
                .gather(1, take).flatten(),
                positions=10 + take, cuts=torch.full((4,), 10),
                root_token_ids=torch.tensor([7, 8, 9, 9]), root_positions=10 + counts)
    step["next_token_ids"][-4:] = step["next_token_ids"][-8:-4]  # padding repeats
    step["target_hidden"][-4:] = step["target_hidden"][-8:-4]
    return runtimes, {name: value.to(device) for name, value in step.items()}


@pytest.mark.parametrize("shape", [(1, 5, 6), (4, 4, 16)])
def test_fused_decode_step_equals_ingest_then_draft(shape):
    """What the V2 speculator runs when every request decodes (ingest and
    drafting in one pass, one graph replay on CUDA; here eagerly) leaves the
    cache and drafts the trees that the padded ingest followed by a drafting
    pass give, for chains and trees."""
    runtimes, step = _fused_step_runtimes(seed=3)
    num_keys = 64  # the keys bucket both paths read
    emitted = []
    runtimes[0].decode_step(*step.values(), num_keys, shape,
                            lambda slots, tree: emitted.append((slots.clone(), tree)))
    runtimes[1].ingest_padded(step["slots"], step["target_hidden"], step["next_token_ids"],
                              step["positions"], step["cuts"], max_position=num_keys - 1)
    want = runtimes[1].draft_slots(step["slots"], step["root_token_ids"],
                                   step["root_positions"], num_keys, *shape)
    (slots, tree), = emitted
    assert torch.equal(slots, step["slots"])
    for name in ("token_ids", "parent_ids", "depths", "positions", "packed_mask"):
        assert torch.equal(getattr(tree, name), getattr(want, name)), name
    fused, separate = (r.pool for r in runtimes)
    for name in ("keys", "values", "valid", "last_out", "last_logits"):
        assert torch.equal(getattr(fused, name), getattr(separate, name)), name
    assert fused.valid[1, :14].all() and not fused.valid[1, 14:].any()


@pytest.mark.parametrize("num_nodes", [2, 3, 4])
def test_a_beam_as_wide_as_the_kept_nodes_drafts_the_same_tree(num_nodes):
    """`step_tree_shape` narrows topk to num_nodes - 1: the tree a 4-wide
    search keeps is the one the narrow search keeps (same nodes, same
    parents, same order), on a random head."""
    from vllm_specplug.integration.v2.step_inputs import step_tree_shape

    runtimes, step = _fused_step_runtimes(seed=num_nodes)
    runtime = runtimes[0]
    runtime.ingest_padded(step["slots"], step["target_hidden"], step["next_token_ids"],
                          step["positions"], step["cuts"], max_position=63)
    narrow = step_tree_shape((4, 4, 16), num_nodes - 1)
    assert narrow == (num_nodes - 1, num_nodes - 1, num_nodes)
    wide = (4, *narrow[1:])
    trees = [runtime.draft_slots(step["slots"], step["root_token_ids"], step["root_positions"],
                                 64, *shape) for shape in (wide, narrow)]
    for name in ("token_ids", "parent_ids", "depths", "positions", "packed_mask"):
        assert torch.equal(getattr(trees[0], name), getattr(trees[1], name)), name


def scheduled_output(finished=(), new=()):
    """A scheduler output as `PrefixBlocks.schedule` reads it: finished
    requests, new ones as (request, block ids, positions computed)."""
    return SimpleNamespace(
        finished_req_ids=set(finished), preempted_req_ids=None,
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=n)
                            for r, ids, n in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]))


def test_prefix_blocks_save_finished_requests_and_hand_them_to_prefix_hits():
    """Model Runner V2's prefix-cache bookkeeping for the head
    (integration/v2/prefix_blocks.py), on scheduler outputs as vLLM builds
    them: a finished request's blocks are saved from its slot with their
    validity; a new request whose computed prefix is those blocks starts
    with them; a block handed out fresh loses its rows; a hit that is not
    whole saved blocks gets nothing."""
    from types import SimpleNamespace as NS

    from vllm_specplug.integration.v2.prefix_blocks import PrefixBlocks
    from vllm_specplug.proposers.head_cache import HeadCachePool

    def output(finished=(), new=(), running=()):
        return NS(finished_req_ids=set(finished), preempted_req_ids=None,
                  scheduled_new_reqs=[NS(req_id=r, block_ids=(ids,), num_computed_tokens=n)
                                      for r, ids, n in new],
                  scheduled_cached_reqs=NS(req_ids=[r for r, _ in running],
                                           new_block_ids=[(ids,) for _, ids in running]))

    pool = HeadCachePool(1, 2, 3, 5, torch.float32, torch.device("cpu"), num_slots=4)
    pool.keys[2, 0, :, 0] = torch.arange(pool.capacity, dtype=torch.float32)
    pool.valid[2, :11] = True  # the head ingested positions 0..10 of slot 2
    pool.valid[2, 12] = True
    prefix = PrefixBlocks(block_size=4)
    slots = {"a": 2}
    computed = lambda slot: 13  # noqa: E731 - the scheduler computed 13 positions
    prefix.schedule(output(new=[("a", [7, 8], 0)]), slots.get, computed, pool)
    prefix.schedule(output(running=[("a", [9, 3])]), slots.get, computed, pool)
    prefix.schedule(output(finished=["a"]), slots.get, computed, pool)
    assert sorted(prefix.store.blocks) == [7, 8, 9]  # 13 // 4 whole blocks
    assert prefix.store.blocks[9][2].tolist() == [True, True, True, False]
    assert 3 not in prefix.store.blocks  # position 12 ingested, its block not whole
    # "b" hits blocks 7, 8, 9 (12 positions); "c" hits 7 and a block never saved
    prefix.schedule(output(new=[("b", [7, 8, 9, 5], 12), ("c", [7, 3, 6], 8)]), slots.get,
                    computed, pool)
    assert prefix.adopt("b", 1, 12, pool)
    assert pool.keys[1, 0, :12, 0].tolist() == list(range(12))
    # position 11: never ingested (and the prefix's last row is left out anyway)
    assert pool.valid[1, :12].tolist() == [True] * 11 + [False]
    assert not pool.valid[1, 12:].any()
    assert not prefix.adopt("c", 3, 8, pool) and not pool.valid[3].any()
    assert prefix.num_adopted == 1
    # "c"'s hit of 8 positions is counted missed (bench's `by repeat`)
    assert prefix.stats() == {"adopted": 1, "missed": 1, "missed_positions": 8, "filled": 0}
    # block 8 handed out fresh (a new owner): its rows are gone
    prefix.schedule(output(running=[("b", [8])]), slots.get, computed, pool)
    assert 8 not in prefix.store.blocks and 7 in prefix.store.blocks


def test_prefix_hits_of_one_step_are_adopted_together_as_one_by_one():
    """Several new requests' prefix-cache hits in one step are written into
    their slots together (`PrefixBlocks.adopt_all`, a few launches whatever
    their number: one by one, 64 hits had cost 8 launches each): the pool
    ends as with one `adopt` after the other, each slot holding its own
    prefix with that prefix's last row left out; a miss among them gets
    nothing."""
    from vllm_specplug.integration.v2.prefix_blocks import PrefixBlocks
    from vllm_specplug.proposers.head_cache import HeadCachePool

    def saved_pool_and_blocks():
        pool = HeadCachePool(2, 3, 3, 5, torch.float32, torch.device("cpu"), num_slots=8)
        positions = torch.arange(pool.capacity, dtype=torch.float32)
        pool.keys[0, 0, :, 0], pool.values[0, 1, :, 2] = positions, -positions
        pool.keys[1, 1, :, 1] = 100 + positions
        pool.valid[0, :12] = True
        pool.valid[1, :8] = True
        prefix = PrefixBlocks(block_size=4)
        slots, computed = {"a": 0, "d": 1}, (lambda slot: 12 if slot == 0 else 8)
        prefix.schedule(scheduled_output(new=[("a", [7, 8, 9], 0), ("d", [4, 5], 0)]),
                        slots.get, computed, pool)
        prefix.schedule(scheduled_output(finished=["a", "d"]), slots.get, computed, pool)
        # "b" hits a's 3 blocks, "c" a block never saved, "e" d's 2 blocks
        prefix.schedule(scheduled_output(new=[("b", [7, 8, 9, 6], 12), ("c", [3, 2], 8),
                                              ("e", [4, 5, 1], 8)]), slots.get, computed, pool)
        return pool, prefix

    requests = [("b", 5, 12), ("c", 6, 8), ("e", 7, 8)]
    together, prefix = saved_pool_and_blocks()
    assert prefix.adopt_all(requests, together).tolist() == [True, False, True]
    assert prefix.num_adopted == 2
    one_by_one, prefix = saved_pool_and_blocks()
    assert [prefix.adopt(*request, one_by_one) for request in requests] == [True, False, True]
    for name in ("keys", "values", "valid"):
        assert torch.equal(getattr(together, name), getattr(one_by_one, name)), name
    assert np.array_equal(together.last_positions, one_by_one.last_positions)
    assert together.last_positions[5:].tolist() == [11, -1, 7]
    assert together.keys[5, 0, :12, 0].tolist() == list(range(12))
    assert together.values[5, 1, :12, 2].tolist() == [-float(i) for i in range(12)]
    assert together.keys[7, 1, :8, 1].tolist() == [100.0 + i for i in range(8)]
    assert together.valid[5].tolist()[:13] == [True] * 11 + [False, False]
    assert together.valid[7].tolist()[:9] == [True] * 7 + [False, False]
    assert not together.valid[6].any()


def test_requests_finished_in_one_step_are_saved_as_one_by_one():
    """The requests that finish in one step are each saved from their slot
    (`HeadBlockStore.save_blocks`, a saved block an index into its request's
    span, its views made when read): each block holds the rows and validity
    of its slot there, as when they finish one step after the other."""
    from types import SimpleNamespace as NS

    from vllm_specplug.integration.v2.prefix_blocks import PrefixBlocks
    from vllm_specplug.proposers.head_cache import HeadCachePool

    def scheduled(finished=(), new=()):
        return NS(finished_req_ids=set(finished), preempted_req_ids=None,
                  scheduled_new_reqs=[NS(req_id=r, block_ids=(ids,), num_computed_tokens=0)
                                      for r, ids in new],
                  scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[]))

    def saved(steps):
        pool = HeadCachePool(2, 3, 3, 5, torch.float32, torch.device("cpu"), num_slots=4)
        pool.keys.copy_(torch.randn(pool.keys.shape, generator=torch.Generator().manual_seed(3)))
        pool.values.copy_(-pool.keys)
        pool.valid[1, :9] = True
        pool.valid[2, :6] = True
        pool.valid[2, 7] = True
        prefix = PrefixBlocks(block_size=4)
        slots, computed = {"a": 1, "b": 2}, (lambda slot: 10 if slot == 1 else 8)
        prefix.schedule(scheduled(new=[("a", [7, 8, 9]), ("b", [4, 5])]), slots.get,
                        computed, pool)
        for finished in steps:
            prefix.schedule(scheduled(finished=finished), slots.get, computed, pool)
        return {b: [t.clone() for t in block] for b, block in prefix.store.blocks.items()}, pool

    (together, pool), (one_by_one, _) = saved([["a", "b"]]), saved([["a"], ["b"]])
    assert sorted(together) == sorted(one_by_one) == [4, 5, 7, 8]  # 10 // 4 of a's blocks
    for b in together:
        assert all(torch.equal(x, y) for x, y in zip(together[b], one_by_one[b])), b
    assert together[8][2].tolist() == [True] * 4 and together[5][2].tolist() == [
        True, True, False, True]
    assert torch.equal(together[8][0], pool.keys[1, :, 4:8])  # a's second block
    assert torch.equal(together[5][1], pool.values[2, :, 4:8])  # b's second


def test_a_finished_prefix_hit_keeps_the_saved_rows_of_its_hit_blocks():
    """A request that finishes on a prefix-cache hit saves only its blocks
    not saved yet (PrefixBlocks._save): its hit blocks' saved rows stay as
    they were, with the row its adoption left out, and so do the rows of a
    hit it could not adopt, which its head never ingested; the blocks it
    filled itself are saved."""
    from vllm_specplug.integration.v2.prefix_blocks import PrefixBlocks
    from vllm_specplug.proposers.head_cache import HeadCachePool

    pool = HeadCachePool(1, 2, 3, 5, torch.float32, torch.device("cpu"), num_slots=4)
    pool.keys[0, 0, :, 0] = torch.arange(pool.capacity, dtype=torch.float32)
    pool.valid[0, :8] = True
    prefix = PrefixBlocks(block_size=4)
    slots, computed = {"a": 0, "b": 1}, (lambda slot: 8 if slot == 0 else 12)
    prefix.schedule(scheduled_output(new=[("a", [7, 8], 0)]), slots.get, computed, pool)
    prefix.schedule(scheduled_output(finished=["a"]), slots.get, computed, pool)
    saved = {b: [t.clone() for t in prefix.store.blocks[b]] for b in (7, 8)}
    # "b" hits blocks 7 and 8, adopts them, then fills block 5 itself
    prefix.schedule(scheduled_output(new=[("b", [7, 8, 5], 8)]), slots.get, computed, pool)
    assert prefix.adopt("b", 1, 8, pool) and not pool.valid[1, 7]  # the left-out row
    pool.keys[1, 0, 8:12, 0] = torch.tensor([50.0, 51.0, 52.0, 53.0])
    pool.valid[1, 8:12] = True
    prefix.schedule(scheduled_output(finished=["b"]), slots.get, computed, pool)
    for b in (7, 8):  # as "a" saved them: row 7 still valid
        assert all(torch.equal(x, y) for x, y in zip(prefix.store.blocks[b], saved[b])), b
    assert prefix.store.blocks[8][2].tolist() == [True] * 4
    assert prefix.store.blocks[5][0][0, :, 0].tolist() == [50.0, 51.0, 52.0, 53.0]
    assert prefix.store.blocks[5][2].tolist() == [True] * 4


def test_a_hit_not_adopted_never_saves_the_blocks_it_did_not_ingest():
    """A burst of requests on a new shared prefix: "a" fills block 3 while
    "c" starts on it as a prefix-cache hit (vLLM caches a block once it is
    scheduled), before any request saved it, so "c" drafts from its own
    positions. "c" finishing first must not save block 3 from its slot
    (empty there): saved, every later hit would adopt empty rows and "a"
    would find block 3 saved and never save its own. Here "a"'s rows of
    block 3 are what a later hit gets."""
    from vllm_specplug.integration.v2.prefix_blocks import PrefixBlocks
    from vllm_specplug.proposers.head_cache import HeadCachePool

    pool = HeadCachePool(1, 2, 3, 5, torch.float32, torch.device("cpu"), num_slots=4)
    pool.keys[0, 0, :, 0] = torch.arange(pool.capacity, dtype=torch.float32)
    pool.valid[0, :8] = True  # "a" ingested its 8 positions; "c" only 4..7 of its own
    pool.keys[1, 0, :, 0] = -1.0
    pool.valid[1, 4:8] = True
    prefix = PrefixBlocks(block_size=4)
    slots, computed = {"a": 0, "c": 1, "d": 2}, (lambda slot: 8)
    prefix.schedule(scheduled_output(new=[("a", [3, 9], 0), ("c", [3, 6], 4)]), slots.get,
                    computed, pool)
    assert prefix.adopt_all([("c", 1, 4)], pool).tolist() == [False]
    prefix.schedule(scheduled_output(finished=["c"]), slots.get, computed, pool)
    assert 3 not in prefix.store.blocks and 6 in prefix.store.blocks  # c's own block saved
    prefix.schedule(scheduled_output(finished=["a"]), slots.get, computed, pool)
    assert prefix.store.blocks[3][0][0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert prefix.store.blocks[3][2].tolist() == [True] * 4
    # "d" hits block 3 and gets "a"'s rows (its last one left out: no next token given)
    prefix.schedule(scheduled_output(new=[("d", [3, 5], 4)]), slots.get, computed, pool)
    assert prefix.adopt("d", 2, 4, pool)
    assert pool.keys[2, 0, :4, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert pool.valid[2, :4].tolist() == [True, True, True, False]
    assert prefix.stats() == {"adopted": 1, "missed": 1, "missed_positions": 4, "filled": 0}


def test_a_missed_hit_takes_its_rows_from_the_request_that_filled_them():
    """Requests on a shared prefix in one step (a burst, `n` > 1 samples):
    "b" and "e" hit block 3 that "a" fills in the same step, so they cannot
    adopt it; after the step's prefill ingest (`PrefixBlocks.fill_missed`)
    each takes "a"'s rows of it, the last one only where its own next token
    is "a"'s. "x", whose hit's blocks no running request holds, stays
    empty; none of them saves block 3 at its finish, "a" does."""
    from vllm_specplug.integration.v2.prefix_blocks import PrefixBlocks
    from vllm_specplug.proposers.head_cache import HeadCachePool

    pool = HeadCachePool(1, 2, 3, 5, torch.float32, torch.device("cpu"), num_slots=5)
    prefix = PrefixBlocks(block_size=4)
    slots = {"a": 0, "b": 1, "e": 2, "x": 3}
    prefix.schedule(scheduled_output(new=[("a", [3, 9], 0), ("b", [3, 6], 4), ("e", [3, 7], 4),
                                          ("x", [8, 5], 4)]), slots.get, lambda s: 8, pool)
    assert prefix.adopt_all([("b", 1, 4), ("e", 2, 4), ("x", 3, 4)], pool).tolist() == [
        False] * 3
    # the step's prefill ingest: "a" its 8 positions, the others their own 4..7
    pool.keys[0, 0, :8, 0] = torch.arange(8, dtype=torch.float32)
    pool.valid[0, :8] = True
    pool.keys[1:4, 0, 4:8, 0] = -1.0
    pool.valid[1:4, 4:8] = True
    token_ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]] * 4)
    token_ids[2, 4] = 9  # "e" goes on otherwise after the shared block
    prefix.fill_missed(slots.get, pool, token_ids)
    assert pool.keys[1, 0, :8, 0].tolist() == [0.0, 1.0, 2.0, 3.0] + [-1.0] * 4
    assert pool.valid[1, :8].all()
    assert pool.keys[2, 0, :4, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert pool.valid[2, :8].tolist() == [True] * 3 + [False] + [True] * 4
    assert not pool.valid[3, :4].any()
    assert prefix.stats()["filled"] == 2 and not prefix.pending
    prefix.schedule(scheduled_output(finished=["b", "e", "x"]), slots.get, lambda s: 8, pool)
    assert 3 not in prefix.store.blocks and {6, 7, 5} <= set(prefix.store.blocks)
    prefix.schedule(scheduled_output(finished=["a"]), slots.get, lambda s: 8, pool)
    assert prefix.store.blocks[3][0][0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_drafts_vllm_marks_invalid_are_never_accepted():
    """A request under a reasoning section's chain rules: vLLM marks its
    drafts past the valid chain prefix invalid by logits row
    (`invalid_drafts`); the walk reads those nodes' tokens as -1."""
    from vllm_specplug.integration.v2.tree_sampler import node_token_ids
    from vllm_specplug.verification.tree_greedy_rows import verify_tree_greedy_rows

    # one request, a chain of 3 drafts [7, 8, 9] after the root token 5; the
    # target agrees with every draft (argmax at row i = the token of node i + 1)
    input_ids = torch.tensor([5, 7, 8, 9], dtype=torch.int32)
    logits_indices = torch.arange(4)
    target = torch.tensor([7, 8, 9, 4])
    args = (logits_indices, torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([[-1, 0, 1, 2]]), torch.tensor([0], dtype=torch.int32))
    slot_num_nodes = torch.tensor([4], dtype=torch.int32)
    walk = lambda ids: verify_tree_greedy_rows(  # noqa: E731
        target, ids, *args, slot_num_nodes=slot_num_nodes, backend="torch")
    assert node_token_ids(input_ids, logits_indices, None) is input_ids
    assert walk(input_ids).num_accepted.tolist() == [3]
    invalid = torch.tensor([False, False, True, True])  # drafts past the first: invalid
    masked = node_token_ids(input_ids, logits_indices, invalid)
    assert input_ids.tolist() == [5, 7, 8, 9]  # the step's own ids untouched
    out = walk(masked)
    assert out.num_accepted.tolist() == [1]
    assert out.output_token_ids[0, :2].tolist() == [7, 8]  # node 1, then the bonus at it


def test_start_up_steps_leave_no_trace_and_cover_every_steady_shape():
    """`warm_up_step_graphs` (what the head speculator's `capture()` runs on
    CUDA, there capturing each step as a graph; here eagerly) runs one
    placeholder step per padded batch size and per steady step of the
    lengths vLLM may ask for, and `warm_up_mixed_passes` the two passes a
    step with prefills runs apart at the same keys; then both forget them:
    the head's cache, the trees and the drafts are as before, and a runtime
    that ran them drafts and caches what one that did not does."""
    from tests.test_tree_eagle_unit import _gqa_head
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    from vllm_specplug.integration.v2.step_inputs import StepInputs, step_tree_shape
    from vllm_specplug.integration.v2.step_warmup import (padded_sizes, steady_steps, step_keys,
                                                          warm_up_mixed_passes,
                                                          warm_up_step_graphs)
    from vllm_specplug.proposers.head_graphs import MAX_GRAPHS
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    head = _gqa_head(3)
    generator = torch.Generator().manual_seed(3)
    embed = torch.nn.Embedding(50, 32, _weight=torch.randn(50, 32, generator=generator))
    runtimes = [HeadRuntime(head, embed) for _ in range(2)]
    for runtime in runtimes:
        runtime.make_pool(4, torch.float32, "cpu")
    fresh_slots = TreeSlots(5, 16, "cpu")  # 4 requests' slots and the padding's spare one
    warm = SimpleNamespace(runtime=runtimes[0], step_inputs=StepInputs(4, 8, torch.device("cpu")),
                           drafter=SimpleNamespace(tree_shape=(4, 4, 16)), max_num_reqs=4,
                           device=torch.device("cpu"), tree_slots=TreeSlots(5, 16, "cpu"),
                           drafts=torch.zeros(4, 15, dtype=torch.int64))
    warm._emit = lambda slots, tree: SpecplugV2HeadSpeculator._emit(warm, slots, tree)
    emitted = []
    emit = warm._emit
    warm._emit = lambda slots, tree: emitted.append(slots.shape[0]) or emit(slots, tree)
    lengths = (0, 4, 15)
    steps = steady_steps(lengths, (4, 4, 16), step_tree_shape)
    assert steps == [(1, (1, 1, 2)), (8, (4, 4, 5)), (8, (4, 4, 16))]
    # a prompt lookup's branch 8 deep (`verified_depth`): 9 rows, padded to 16
    assert steady_steps(lengths, (4, 4, 16), step_tree_shape, 8) == [
        (1, (1, 1, 2)), (8, (4, 4, 5)), (16, (4, 4, 16))]
    assert padded_sizes(4) == [1, 2, 4] and padded_sizes(13) == [1, 2, 4, 8, 16]
    keys = step_keys(lengths, None, (4, 4, 16), step_tree_shape, 4)
    count = warm_up_step_graphs(warm, keys, 48, torch.float32)
    assert count == 9 and sorted(emitted) == [1, 1, 1, 2, 2, 2, 4, 4, 4]
    assert not runtimes[0].pool.valid.any() and not warm.drafts.any()
    # a step with prefills runs the ingest and the drafting pass apart: both,
    # at every key, also forgotten; none where they would crowd the graphs
    assert warm_up_mixed_passes(warm, keys, 48, torch.float32) == 2 * len(keys) == 18
    assert not runtimes[0].pool.valid.any() and not warm.drafts.any()
    crowded = keys * (MAX_GRAPHS // (2 * len(keys)) + 1)  # a policy's many lengths
    assert warm_up_mixed_passes(warm, crowded, 48, torch.float32) == 0
    # graphs held already count: the fused steps' and kept rows' are not pushed out
    held = dict.fromkeys(range(MAX_GRAPHS - 2 * len(keys) + 1))
    warm.runtime.graphs = SimpleNamespace(graphs=held, disabled=set())
    assert warm_up_mixed_passes(warm, keys, 48, torch.float32) == 0
    warm.runtime.graphs = None
    for name in ("parents", "depths", "is_tree", "num_drafted"):
        assert torch.equal(getattr(warm.tree_slots, name), getattr(fresh_slots, name)), name
    # then the same requests on both runtimes: same caches, same trees
    prefix = torch.randn(30, 48, generator=generator)
    prefix_ids = torch.randint(0, 50, (30,), generator=generator)
    trees = []
    for runtime in runtimes:
        runtime.ingest_slots(np.array([0, 1, 2]), np.ones(3, dtype=bool), prefix, prefix_ids,
                             np.tile(np.arange(10), 3), [10, 10, 10])
        trees.append(runtime.draft_slots(torch.tensor([0, 1, 2]), torch.tensor([4, 5, 6]),
                                         torch.tensor([10, 10, 10]), 16, 4, 4, 16))
    for name in ("token_ids", "parent_ids", "depths", "packed_mask"):
        assert torch.equal(getattr(trees[0], name), getattr(trees[1], name)), name
    warmed, plain = (r.pool for r in runtimes)
    assert torch.equal(warmed.valid, plain.valid)
    for name in ("keys", "values"):
        assert torch.equal(getattr(warmed, name)[:3, :, :10], getattr(plain, name)[:3, :, :10])
    for name in ("last_out", "last_logits"):
        assert torch.equal(getattr(warmed, name)[:3], getattr(plain, name)[:3]), name


def test_a_kind_whose_start_up_capture_failed_is_tried_again_in_service(caplog):
    """A warm-up whose capture failed (PassGraphs put its kind in `disabled`)
    hands that kind back to first use in service, with a warning; a kind
    disabled before the warm-up, or one the warm-up does not capture, stays
    as it was."""
    from vllm_specplug.integration.v2.step_warmup import MIXED_KINDS, _enable_again

    disabled = {"ingest", "draft", "step"}  # "ingest" failed before, "draft" and "step" now
    with caplog.at_level("WARNING", logger="vllm_specplug.tree_drafter"):
        _enable_again(disabled, {"ingest"}, MIXED_KINDS)
    assert disabled == {"ingest", "step"}
    assert [r.getMessage() for r in caplog.records] == [
        "vllm-specplug: the head's draft graphs were not captured at start-up; "
        "they are captured on first use instead"]


def test_start_up_covers_the_steps_where_a_tables_draft_length_changes():
    """A vLLM table from 5 drafts to 2 at 5 requests (the chain of the GPU
    test): where the batch drains to 4, the first step verifies 2's rows (4,
    padded) and drafts 5's chain; where it grows past 4, it verifies 5's (8)
    and drafts 2's. Start-up captures those too; under our batch policy,
    whose table only lists lengths, it does not."""
    from types import SimpleNamespace

    from vllm_specplug.integration.v2.step_inputs import step_tree_shape
    from vllm_specplug.integration.v2.step_warmup import step_keys, table_of, transition_steps

    chain, table = (1, 5, 6), [[1, 4, 5], [5, 1024, 2]]
    five, two = step_tree_shape(chain, 5), step_tree_shape(chain, 2)
    found = transition_steps(table, chain, step_tree_shape, 16)
    assert found == sorted([(1, 4, five), (2, 4, five), (4, 4, five),
                            (8, 8, two), (16, 8, two)]), found
    steady = step_keys((2, 5), None, chain, step_tree_shape, 16)
    assert len(steady) == 2 * 5 and not set(found) & set(steady)
    assert step_keys((2, 5), table, chain, step_tree_shape, 16) == sorted(set(steady) | set(found))
    config = SimpleNamespace(speculative_config=SimpleNamespace(
        num_speculative_tokens_per_batch_size=table), scheduler_config=SimpleNamespace(
        scheduler_cls="vllm_specplug.integration.scheduler.SpecplugTreeAsyncScheduler"))
    assert table_of(config) == table
    config.scheduler_config.scheduler_cls = (
        "vllm_specplug.integration.batch_schedule.SpecplugBatchDraftTreeAsyncScheduler")
    assert table_of(config) is None


def test_the_runners_output_carries_a_tree_heads_path_ranks():
    """The V2 runner's `sample_tokens` patch puts a step's path ranks on the
    runner output for the head's speculator, not only the model-free one's
    draft lengths (on the H200 none reached the policy before: 0 path steps
    of 40, docs/results/batch_draft_length_h200_run8)."""
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_specplug.integration.batch_schedule import PATH_RANKS_ATTR
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    from vllm_specplug.integration.v2.path_ranks import PathRanks
    from vllm_specplug.patches.gpu_v2_model_runner import _sample_tokens

    speculator = object.__new__(SpecplugV2HeadSpeculator)  # what the patch reads of it
    speculator.path_ranks = PathRanks(2, 4, torch.device("cpu"))
    ranks = torch.tensor([[0, 1, 4], [4, 4, 4]])
    for _ in range(2):  # a step's ranks come out at the next step
        speculator.path_ranks.record(ranks, 3, np.array([0, 1]))
    runner = SimpleNamespace(speculator=speculator)
    output = _sample_tokens(lambda self, grammar_output: ModelRunnerOutput([], {}))(runner, None)
    num_drafts, got = getattr(output, PATH_RANKS_ATTR)
    assert num_drafts == 3 and got.tolist() == ranks.tolist()
