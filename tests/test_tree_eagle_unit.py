"""specplug_eagle3 without an engine: options and head checks in the front
end (named errors before any engine starts), trees from scheduled node
lists, the CPU kernel's KV layout probe, and the head's tree drafting."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_specplug.proposers.base import ProposerConfigError
from vllm_specplug.verification.metadata import NO_NODE
from vllm_specplug.verification.tree_build import tree_from_parents
from vllm_specplug.verification.tree_greedy import verify_tree_greedy


def engine_args_error(model_dir, spec: dict) -> str:
    from vllm.engine.arg_utils import EngineArgs

    import vllm_specplug.plugin as plugin

    plugin.register()
    args = EngineArgs(model=str(model_dir), speculative_config=spec, dtype="float32")
    with pytest.raises(ProposerConfigError) as info:
        args.create_engine_config()
    return str(info.value)


@pytest.mark.parametrize("options, field", [
    ({"topk": 2, "num_steps": 3, "num_draft_tokens": 16}, "num_draft_tokens"),
    ({"topk": 0}, "topk"),
    ({"num_steps": "4"}, "num_steps"),
    ({"topk": 4096}, "topk"),
    ({"depth": 3}, "depth"),
    ({"draft_temperature": 0.0}, "draft_temperature"),
    ({"draft_cudagraph": "yes"}, "draft_cudagraph"),
    ({"draft_compile": "yes"}, "draft_compile"),
    ({"draft_dtype": "fp8"}, "draft_dtype"),
])
def test_bad_options_name_the_field(tiny_model_dir, tiny_eagle3_dir, options, field):
    spec = {"method": "specplug_eagle3", "model": str(tiny_eagle3_dir), **options}
    assert field in engine_args_error(tiny_model_dir, spec)


def test_adaptive_verification_is_for_chains_only(tiny_eagle3_dir):
    """vLLM's `enable_adaptive_verification` ranks chain positions by the
    confidences a chain's drafting pass fills: a tree, or a model-free
    method (which has `adaptive`), is refused in the front end, naming the
    fix; an EAGLE-3 chain passes it on to vLLM."""
    from vllm_specplug.integration.config import translate

    head = {"method": "specplug_eagle3", "model": str(tiny_eagle3_dir),
            "enable_adaptive_verification": True}
    vllm_config, selection = translate({**head, "topk": 1, "num_steps": 3})
    assert vllm_config["enable_adaptive_verification"] is True
    assert selection.method == "specplug_eagle3"
    for config in ({**head, "topk": 4, "num_steps": 4, "num_draft_tokens": 16},
                   {**head, "topk": 1, "num_steps": 3, "prompt_lookup_min": 3},
                   {"method": "specplug_ngram", "num_speculative_tokens": 3,
                    "enable_adaptive_verification": True}):
        with pytest.raises(ProposerConfigError,
                           match=r"enable_adaptive_verification=true needs a chain .*"
                                 r"Set topk=1 and prompt_lookup_min=0, or drop "
                                 r"enable_adaptive_verification"):
            translate(config)


def test_missing_head_directory_is_named(tiny_model_dir, tmp_path):
    spec = {"method": "specplug_eagle3", "model": str(tmp_path / "nope")}
    assert "config.json" in engine_args_error(tiny_model_dir, spec)


def copy_head(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_head_for_another_target_is_refused(tiny_model_dir, tiny_eagle3_dir, tmp_path):
    head = copy_head(tiny_eagle3_dir, tmp_path / "head")
    config = json.loads((head / "config.json").read_text())
    config["target_hidden_size"] = 256
    (head / "config.json").write_text(json.dumps(config))
    message = engine_args_error(tiny_model_dir, {"method": "specplug_eagle3",
                                                 "model": str(head)})
    assert "target_hidden_size 256" in message


def test_head_with_missing_tensor_is_refused(tiny_model_dir, tiny_eagle3_dir, tmp_path):
    head = copy_head(tiny_eagle3_dir, tmp_path / "head")
    tensors = load_file(str(head / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(head / "model.safetensors"))
    message = engine_args_error(tiny_model_dir, {"method": "specplug_eagle3",
                                                 "model": str(head)})
    assert "missing fc.weight" in message


def test_padded_trees_verify_like_each_tree_alone():
    """tree_from_parents: padding nodes are unreachable, real nodes keep
    their links, and greedy verification of the batch equals each alone."""
    parents = torch.tensor([[NO_NODE, 0, 0, 1, 2], [NO_NODE, 0, 1, 0, 0]])
    tokens = torch.tensor([[9, 3, 4, 5, 6], [9, 3, 5, 7, 7]])
    num_nodes = torch.tensor([5, 3])
    tree = tree_from_parents(tokens, parents, num_nodes, torch.tensor([10, 20]))
    assert tree.first_child_ids[1].tolist() == [1, 2, NO_NODE, NO_NODE, NO_NODE]
    assert tree.positions[0].tolist() == [10, 11, 11, 12, 12]
    argmax = torch.tensor([[4, 0, 6, 0, 8], [3, 5, 1, 7, 7]])
    batched = verify_tree_greedy(tree, argmax, backend="torch")
    assert batched.accepted_node_ids[0, :3].tolist() == [0, 2, 4]
    assert batched.output_token_ids[0, :3].tolist() == [4, 6, 8]
    # request 1 accepts 1 -> 2 and never its padding nodes 3, 4 (token 7 = argmax)
    assert batched.accepted_node_ids[1, :3].tolist() == [0, 1, 2]
    assert int(batched.num_accepted[1]) == 2


@pytest.mark.parametrize("isa, block_size", [("vec", 32), ("vec16", 16)])
def test_cpu_layout_probe_reads_and_writes_what_the_kernel_wrote(isa, block_size):
    from vllm import _custom_ops as ops

    from vllm_specplug.integration.v1.cpu_kv_layout import probe_layout

    heads, size = 2, 32
    layout = probe_layout(isa, block_size, heads, size, torch.float32)
    cache = torch.zeros(3, heads, block_size, 2 * size)
    key_cache, value_cache = cache.view(3, heads, 2 * block_size, size).chunk(2, dim=2)
    keys, values = torch.randn(37, heads, size), torch.randn(37, heads, size)
    slots = torch.randperm(3 * block_size)[:37]
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    read_keys, read_values = layout.read(cache, slots)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    rewritten = torch.zeros_like(cache)
    layout.write(rewritten, slots, keys, values)
    assert torch.equal(rewritten, cache)


def test_head_drafts_valid_trees(tiny_eagle3_dir):
    """Trees from the head: right size, parents first, depth <= num_steps,
    distinct siblings, and topk=1 a chain."""
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    head = load_head(tiny_eagle3_dir)
    torch.manual_seed(0)
    runtime = HeadRuntime(head, torch.nn.Embedding(head.config.vocab_size,
                                                   head.config.hidden_size))
    aux_width = len(head.config.aux_layer_ids) * head.config.target_hidden_size
    for req_id, length in (("a", 9), ("b", 3)):
        runtime.ingest(req_id, torch.randn(length, aux_width),
                       torch.randint(0, 4096, (length,)), torch.arange(length))
    roots, positions = torch.tensor([5, 6]), torch.tensor([9, 3])
    for topk, steps, nodes in ((1, 4, 5), (4, 5, 16), (8, 8, 64)):
        tree = runtime.draft_trees(["a", "b"], roots, positions, topk, steps, nodes)
        assert tree.token_ids.shape == (2, nodes)
        assert (tree.parent_ids[:, 1:] < torch.arange(1, nodes)).all()
        assert int(tree.depths.max()) <= steps
        assert torch.equal(tree.positions, positions[:, None] + tree.depths)
        if topk == 1:
            assert tree.parent_ids[0].tolist() == list(range(-1, nodes - 1))
        for b in range(2):
            pairs = {(int(p), int(t)) for p, t in zip(tree.parent_ids[b, 1:],
                                                      tree.token_ids[b, 1:])}
            assert len(pairs) == nodes - 1  # siblings carry distinct tokens


def test_batched_ingest_equals_one_request_at_a_time(tiny_eagle3_dir, monkeypatch):
    """`ingest_many` (one pass of the head for all requests, attention over
    padded caches, split into groups) gives each request the cache and
    logits that ingesting it alone gives, including a resumed request whose
    later rows are replaced."""
    from vllm_specplug.proposers import eagle3_head
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    head = load_head(tiny_eagle3_dir)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(head.config.vocab_size, head.config.hidden_size)
    width = len(head.config.aux_layer_ids) * head.config.target_hidden_size
    one, many = HeadRuntime(head, embed), HeadRuntime(head, embed)
    monkeypatch.setattr(eagle3_head, "ATTENTION_ELEMENTS", 4 * 12 * 12)  # several groups
    for lengths, resume in (((9, 3, 12), (0, 0, 0)), ((2, 1, 4), (9, 3, 7))):
        rows = [(f"r{i}", torch.randn(n, width), torch.randint(0, 4096, (n,)),
                 torch.arange(n) + start) for i, (n, start) in enumerate(zip(lengths, resume))]
        for req_id, hidden, ids, pos in rows:
            one.ingest(req_id, hidden, ids, pos)
        many.ingest_many([r[0] for r in rows], torch.cat([r[1] for r in rows]),
                         torch.cat([r[2] for r in rows]), torch.cat([r[3] for r in rows]),
                         list(lengths))
        for req_id, *_ in rows:
            a, b = one.cache_of(req_id), many.cache_of(req_id)
            assert (a.positions == b.positions).all()
            assert one.last_position(req_id) == many.last_position(req_id) == a.positions[-1]
            for name in ("keys", "values", "last_out", "last_logits"):
                torch.testing.assert_close(getattr(b, name), getattr(a, name),
                                           atol=1e-5, rtol=1e-5)


def _gqa_head(seed: int = 0):
    """A random EAGLE-3 head with grouped-query attention (4 query heads per
    2 KV heads), small enough for the CPU."""
    from vllm_specplug.draft_models.eagle3_model import Eagle3Head, HeadConfig

    config = HeadConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=50,
                        draft_vocab_size=50, target_hidden_size=24, aux_layer_ids=[0, 1],
                        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096)
    head = Eagle3Head(config)
    head.reset_parameters(torch.Generator().manual_seed(seed))
    return head.eval()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5),
                                              (torch.bfloat16, 3e-2)])
def test_runtime_cache_matches_the_training_forward(dtype, tolerance):
    """The runtime's pooled cache, filled in three ingests (a prefill, one
    position, a chunk), gives the logits at every ingested position that the
    training forward (one causal pass, `Eagle3Head.forward` step 0, float32)
    gives: an independent implementation of the same attention, with GQA.
    In bfloat16 (`draft_dtype`) within bf16 rounding, with the cache pool
    and the weights in bf16 and rotary frequencies kept in float32."""
    import copy

    from vllm_specplug.proposers.draft_layers import cast_parameters
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    head = _gqa_head(seed=4)
    torch.manual_seed(1)
    embed = torch.nn.Embedding(50, 32)
    aux, next_ids = torch.randn(13, 48), torch.randint(0, 50, (13,))
    with torch.no_grad():
        want = head(aux[None], embed(next_ids)[None], torch.arange(13),
                    torch.ones(1, 13, dtype=torch.bool), 1)[0][0]  # [13, Vd]
    runtime = HeadRuntime(cast_parameters(copy.deepcopy(head), dtype), embed)
    assert runtime.layer.head.inv_freq.dtype == torch.float32
    for chunk in (slice(0, 7), slice(7, 8), slice(8, 13)):
        rows = torch.arange(13)[chunk]
        runtime.ingest("r", aux[chunk], next_ids[chunk], rows)
        got = runtime.cache_of("r").last_logits
        assert got.dtype == dtype and runtime.pool.keys.dtype == dtype
        torch.testing.assert_close(got.float(), want[chunk.stop - 1],
                                   atol=tolerance * want.abs().max().item(), rtol=tolerance)
    assert runtime.last_position("r") == 12


def test_batched_drafts_equal_each_request_alone():
    """Drafting a batch (caches of different lengths read as one padded
    tensor) gives every request the tree it gets alone, and growing the pool
    (more requests and positions than first allocated) keeps every cache."""
    from vllm_specplug.proposers import head_cache
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    head = _gqa_head(seed=3)
    torch.manual_seed(2)
    embed = torch.nn.Embedding(50, 32)
    runtime = HeadRuntime(head, embed, num_slots=1)
    lengths = {"a": 5, "b": 300, "c": 1}  # 300 > MIN_CAPACITY: the pool grows
    assert lengths["b"] > head_cache.MIN_CAPACITY
    for req_id, length in lengths.items():
        runtime.ingest(req_id, torch.randn(length, 48), torch.randint(0, 50, (length,)),
                       torch.arange(length))
    assert runtime.pool.num_slots >= 3 and runtime.pool.capacity >= 300
    roots = torch.tensor([7, 8, 9])
    positions = torch.tensor([lengths[r] for r in "abc"])
    batched = runtime.draft_trees(list("abc"), roots, positions, 3, 4, 10)
    for b, req_id in enumerate("abc"):
        alone = runtime.draft_trees([req_id], roots[b:b + 1], positions[b:b + 1], 3, 4, 10)
        assert torch.equal(alone.token_ids[0], batched.token_ids[b]), req_id
        assert torch.equal(alone.parent_ids[0], batched.parent_ids[b]), req_id
    runtime.forget("b")
    assert runtime.last_position("b") == -1
    runtime.ingest("d", torch.randn(2, 48), torch.randint(0, 50, (2,)), torch.arange(2))
    assert runtime.cache_of("d").positions.tolist() == [0, 1]  # b's old rows are gone


def _decode_ingests(runtime, seed: int = 5) -> None:
    """Prefills of three requests, then decode-like ingests: 1..4 positions
    per request, a batch of three (padded to four), a request alone, and one
    that re-ingests from an earlier position (its later rows are dropped)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = {"a": 6, "b": 11, "c": 3}
    for req_id, length in lengths.items():
        runtime.ingest(req_id, torch.randn(length, 48, generator=generator),
                       torch.randint(0, 50, (length,), generator=generator),
                       torch.arange(length))
    for step in [{"a": 2, "b": 1, "c": 4}, {"b": 3}, {"a": 1, "c": 1, "b": 2}]:
        ids, counts = list(step), list(step.values())
        positions = torch.cat([torch.arange(lengths[r], lengths[r] + n) for r, n in step.items()])
        total = sum(counts)
        runtime.ingest_many(ids, torch.randn(total, 48, generator=generator),
                            torch.randint(0, 50, (total,), generator=generator), positions,
                            counts)
        lengths.update({r: lengths[r] + n for r, n in step.items()})
    runtime.ingest("b", torch.randn(2, 48, generator=generator),
                   torch.randint(0, 50, (2,), generator=generator), torch.tensor([9, 10]))


def assert_same_caches(want_runtime, got_runtime, req_ids) -> None:
    """Both runtimes cache the same positions, K/V rows and last outputs."""
    for req_id in req_ids:
        want, got = want_runtime.cache_of(req_id), got_runtime.cache_of(req_id)
        assert got.positions.tolist() == want.positions.tolist()
        for name in ("keys", "values", "last_out", "last_logits"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name),
                                       atol=1e-5, rtol=1e-5)


def test_padded_decode_ingest_equals_the_eager_ingest():
    """A decode step's ingest padded to fixed shapes (the pass a CUDA graph
    replays; here run eagerly, as after a failed capture) leaves every cache
    as the ragged ingest does: the same positions, K/V rows and last logits,
    and the same drafts after."""
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.head_graphs import PassGraphs

    head = _gqa_head(seed=6)
    embed = torch.nn.Embedding(50, 32)
    ragged = HeadRuntime(head, embed, num_slots=2)
    padded = HeadRuntime(head, embed, num_slots=2)
    padded.graphs = PassGraphs()
    padded.graphs.disabled = {"ingest", "draft"}  # no CUDA here: the padded pass runs eagerly
    calls = []
    original = padded._ingest_pass
    padded._ingest_pass = lambda *a: calls.append(a[3].shape) or original(*a)
    for runtime in (ragged, padded):
        _decode_ingests(runtime)
    assert calls == [(4, 4), (1, 4), (4, 2), (1, 2)]  # (padded batch, rows) per decode ingest
    assert_same_caches(ragged, padded, "abc")
    assert ragged.cache_of("b").positions.tolist() == list(range(11))
    roots, positions = torch.tensor([1, 2, 3]), torch.tensor([9, 11, 8])
    trees = [r.draft_trees(list("abc"), roots, positions, 3, 3, 8) for r in (ragged, padded)]
    assert torch.equal(trees[0].token_ids, trees[1].token_ids)


def test_head_cost_bench_runs_on_cpu(tmp_path):
    """`bench_tree_head.head_steps` (the cost model's drafting input, run on
    the GPU host) on a small head here: one row per (batch, tree shape), eager
    times measured, no graph time without CUDA."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
    import bench_tree_head

    head = _gqa_head()
    head.save_pretrained(tmp_path)
    config = {k: getattr(head.config, k) for k in (
        "vocab_size", "hidden_size", "aux_layer_ids", "target_hidden_size",
        "num_key_value_heads", "head_dim")}
    rows = bench_tree_head.head_steps(tmp_path, config, batch_sizes=(1, 3), context_len=9)
    assert [(r["batch_size"], r["num_nodes"]) for r in rows] == [
        (b, n) for b in (1, 3) for _, _, n in bench_tree_head.HEAD_CONFIGS]
    assert all(r["ingest_s"] > 0 and r["draft_s"] > 0 and r["draft_graph_s"] is None
               for r in rows)


def test_a_failed_capture_sends_only_its_kind_of_pass_to_eager(caplog):
    """A pass whose capture fails is logged and runs eagerly from then on
    (the caller's fallback), without another try; the other kind of pass
    (drafting vs ingest) is still captured."""
    from vllm_specplug.proposers.head_graphs import PassGraphs

    graphs = PassGraphs()

    def failing_pass(x):  # on CPU the capture fails before it is called
        raise RuntimeError("not capturable")

    def warnings(kind):
        return sum(f"head's {kind} pass" in r.getMessage() for r in caplog.records)

    assert graphs.run(0, ("ingest", 1, 2), failing_pass, [torch.zeros(2)]) == (False, None)
    assert graphs.disabled == {"ingest"} and warnings("ingest") == 1
    assert graphs.run(0, ("ingest", 4, 2), failing_pass, [torch.zeros(2)]) == (False, None)
    assert warnings("ingest") == 1  # not tried again
    graphs.run(0, ("draft", 1), failing_pass, [torch.zeros(2)])
    assert graphs.disabled == {"ingest", "draft"} and warnings("draft") == 1


def test_head_block_store_hands_whole_cached_prefixes_to_new_requests():
    """Rows are kept per physical block; a prefix is handed over only when
    every block of it is stored, in block order, and a block written again
    (vLLM reused its id) is forgotten."""
    import numpy as np

    from vllm_specplug.proposers.head_cache import HeadBlockStore, HeadCachePool

    store = HeadBlockStore()
    rows = {b: (torch.full((2, 4, 3), float(b)), torch.full((2, 4, 3), -float(b)))
            for b in (7, 9)}
    span_keys, span_values = (torch.cat([rows[7][i], rows[9][i]], 1) for i in (0, 1))
    store.save_blocks([7, 9], span_keys, span_values)  # one span, two blocks
    span_keys.zero_()  # the store copied the span
    keys, values, valid = store.gather(np.array([9, 7]))
    assert keys[:, :4].eq(9).all() and keys[:, 4:].eq(7).all() and values.eq(-keys).all()
    assert valid.tolist() == [True] * 7 + [False]  # the last row: another request's next token
    assert store.gather(np.array([9, 8])) is None and store.gather(np.array([])) is None
    store.drop(np.array([7]))
    assert store.gather(np.array([9, 7])) is None
    # a block the drafter held only in part (Model Runner V2 saves blocks
    # with their validity bits): only those rows come back valid
    store.save_blocks([5], *rows[7], valid=torch.tensor([True, True, False, False]))
    keys, values, valid = store.gather(np.array([9, 5]))
    assert valid.tolist() == [True] * 6 + [False] * 2
    assert store.blocks[5][2].tolist() == [True, True, False, False]  # gather copied
    pool = HeadCachePool(2, 3, 5, 11, torch.float32, torch.device("cpu"))
    pool.adopt("r", keys, values, valid)
    slot = pool.slot_of["r"]
    assert pool.last_position("r") == 7
    assert pool.valid[slot].tolist()[:9] == [True] * 6 + [False] * 3
    assert pool.keys[slot, :, :4].eq(9).all()


def test_head_block_store_keeps_a_prefixs_last_row_for_the_same_next_token():
    """Saved with the token each block's last row was computed with, a
    prefix's last row comes back valid only for a request whose token after
    the prefix is the same (a repeat, a chat's next turn); for another token,
    or where none was saved, it is left out."""
    import numpy as np

    from vllm_specplug.proposers.head_cache import HeadBlockStore

    store = HeadBlockStore()
    keys = torch.randn(2, 8, 3)
    store.save_blocks([7, 9], keys, -keys, next_ids=torch.tensor([41, 42]))
    store.save_blocks([5], keys[:, :4], keys[:, :4])  # no next token saved
    assert store.gather(np.array([7, 9]), 42)[2].tolist() == [True] * 8
    assert store.gather(np.array([7, 9]), 43)[2].tolist() == [True] * 7 + [False]
    assert store.gather(np.array([7]), 41)[2].tolist() == [True] * 4
    assert store.gather(np.array([9, 5]), 42)[2].tolist() == [True] * 7 + [False]
    *_, valid, lengths = store.gather_many([[7], [7, 9], [5]], torch.tensor([41, 40, 7]))
    assert lengths == [4, 8, 4]
    assert valid.tolist() == [True] * 4 + [True] * 7 + [False] + [True] * 3 + [False]
    # rows read a run at a time: blocks one after the other in a span are one
    # slice, wherever prefixes meet; what comes back is each block's rows in order
    got_keys, got_values, valid, lengths = store.gather_many([[7, 9], [9], [5, 7, 9]],
                                                             torch.tensor([42, 42, 42]))
    blocks = {7: keys[:, :4], 9: keys[:, 4:], 5: keys[:, :4]}
    expected = torch.cat([blocks[b] for b in (7, 9, 9, 5, 7, 9)], 1)
    assert lengths == [8, 4, 12] and torch.equal(got_keys, expected)
    assert torch.equal(got_values[:, :12], -expected[:, :12])
    assert torch.equal(got_values[:, 12:16], expected[:, 12:16])  # block 5: saved as +keys
    assert torch.equal(got_values[:, 16:], -expected[:, 16:])
    assert valid.tolist() == [True] * 24
    # a span saved with fewer next tokens than blocks (a request at the
    # model's length): its blocks past them count as saved without one
    store.save_blocks([11, 13], keys, keys, next_ids=torch.tensor([42]))
    *_, valid, _ = store.gather_many([[11], [11, 13], [7, 9]], torch.tensor([42, 42, 42]))
    assert valid.tolist() == [True] * 4 + [True] * 7 + [False] + [True] * 8


def _runtime(drafter: str):
    """A HeadRuntime over a random EAGLE-3 head or MTP layer (CPU, fp32),
    and the width of what the target hands it per position."""
    from vllm_specplug.proposers.draft_layers import MtpDraftLayer
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    if drafter == "eagle3":
        return HeadRuntime(_gqa_head(seed=6), torch.nn.Embedding(50, 32)), 48
    from tests.test_mtp_unit import random_layer

    layer = MtpDraftLayer(random_layer(6), torch.randn(100, 32))
    return HeadRuntime(layer, torch.nn.Embedding(100, 32)), 32


@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
@pytest.mark.parametrize("num_steps, num_draft_tokens", [(5, 6), (5, 4), (1, 2)])
def test_chain_pass_equals_the_tree_search_at_top_1(drafter, num_steps, num_draft_tokens):
    """The chain drafter's pass (argmax per step, the tree from constants)
    returns what EAGLE-2's search with k = 1 returns: every field of the
    DraftTree, for requests of different lengths in one batch, for both
    one-layer drafters."""
    torch.manual_seed(3)
    runtime, width = _runtime(drafter)
    lengths = {"a": 9, "b": 40, "c": 2}
    for req_id, length in lengths.items():
        runtime.ingest(req_id, torch.randn(length, width), torch.randint(0, 50, (length,)),
                       torch.arange(length))
    slots = torch.tensor([runtime.pool.slot_of[r] for r in lengths])
    roots, positions = torch.tensor([3, 4, 5]), torch.tensor(list(lengths.values()))
    with torch.inference_mode():
        chain = runtime._draft_pass(slots, roots, positions, 64, 1, num_steps,
                                    num_draft_tokens)
        tree = runtime._draft_tree_pass(slots, roots, positions, 64, 1, num_steps,
                                        num_draft_tokens)
    for field in tree.__dataclass_fields__:
        mine, theirs = getattr(chain, field), getattr(tree, field)
        assert (mine is None and theirs is None) or torch.equal(mine, theirs), field
    assert (chain.token_ids[:, 1:] != roots[:, None]).any()  # it drafted something


def test_a_chains_drafting_pass_shows_each_draft_steps_logits_to_its_hook():
    """`draft_logits_hook` (vLLM's acceptance estimator on Model Runner V2)
    sees, at draft step d, the logits whose argmax is draft token d, for the
    pass's slots, and nothing in a tree's pass."""
    torch.manual_seed(4)
    runtime, width = _runtime("eagle3")
    for req_id, length in {"a": 7, "b": 19}.items():
        runtime.ingest(req_id, torch.randn(length, width), torch.randint(0, 50, (length,)),
                       torch.arange(length))
    slots = torch.tensor([runtime.pool.slot_of["a"], runtime.pool.slot_of["b"]])
    seen = []
    runtime.draft_logits_hook = lambda logits, at, step: seen.append((step, logits, at))
    roots, positions = torch.tensor([3, 4]), torch.tensor([7, 19])
    with torch.inference_mode():
        chain = runtime._draft_pass(slots, roots, positions, 64, 1, 5, 6)
    assert [step for step, _, _ in seen] == [0, 1, 2, 3, 4]
    for step, logits, at in seen:
        assert torch.equal(at, slots)
        drafted = runtime.layer.to_target(logits.argmax(-1))
        assert torch.equal(drafted, chain.token_ids[:, step + 1]), step
    seen.clear()
    with torch.inference_mode():
        runtime._draft_pass(slots, roots, positions, 64, 2, 3, 5)
    assert not seen


@pytest.mark.parametrize("topk,num_steps,num_draft_tokens", [(3, 3, 8), (1, 4, 5)])
def test_a_trees_logits_hook_masks_what_each_step_may_draft(topk, num_steps,
                                                            num_draft_tokens):
    """`tree_logits_hook` (a grammar-aware drafter's seam) sees each step's
    logits with the pooled candidates and the beam, and what it returns is
    what the top-k is taken from: a hook that allows one token after the
    root and another after it drafts exactly that path first. Chains go
    through the tree's pass when the hook is set."""
    torch.manual_seed(4)
    runtime, width = _runtime("eagle3")
    runtime.ingest("a", torch.randn(9, width), torch.randint(0, 50, (9,)), torch.arange(9))
    allowed = {0: 11, 1: 23}  # depth -> the one draft id allowed there (else: anything)
    seen = []

    def hook(logits, slots, pooled, beam):
        depth = 0 if pooled is None else 1 + (pooled.token_ids.shape[1] > topk)
        seen.append((tuple(logits.shape), pooled is None, None if beam is None else beam.shape))
        if depth in allowed:
            only = torch.full_like(logits, float("-inf"))
            only[..., allowed[depth]] = 0.0
            return only
        return logits

    runtime.tree_logits_hook = hook
    tree = runtime.draft_trees(["a"], torch.tensor([3]), torch.tensor([9]), topk, num_steps,
                               num_draft_tokens)
    ids, parents = tree.token_ids[0].tolist(), tree.parent_ids[0].tolist()
    first = ids.index(int(runtime.layer.to_target(torch.tensor(11))))
    assert parents[first] == 0
    second = [c for c in range(len(ids)) if parents[c] == first]
    assert second and ids[second[0]] == int(runtime.layer.to_target(torch.tensor(23)))
    assert seen[0][1] and seen[0][2] is None and len(seen[0][0]) == 2  # step 0: [B, V]
    assert all(not fresh and beam == (1, topk) for _, fresh, beam in seen[1:])
    assert len(seen) == num_steps


def test_a_preallocated_pool_keeps_its_rows_and_stays_within_its_budget():
    """`HeadCachePool.preallocate` (Model Runner V2 sizes the head's pool at
    load): as many positions as the budget holds for every slot, up to what
    is asked, never less than held; rows already written stay; a later
    `reserve` past it still grows the pool."""
    from vllm_specplug.proposers.head_cache import MIN_CAPACITY, HeadCachePool

    pool = HeadCachePool(2, 4, 5, 11, torch.float32, torch.device("cpu"), num_slots=4)
    per_position = pool.bytes_per_slot_position
    assert per_position == 2 * 2 * 4 * 4 + 1
    pool.keys[1, :, :3] = 7.0
    pool.valid[1, :3] = True
    version = pool.version
    assert pool.preallocate(6, 2000, budget_bytes=6 * per_position * 1000) == 1000
    assert (pool.num_slots, pool.capacity) == (6, 1000) and pool.version == version + 1
    assert pool.keys[1, :, :3].eq(7.0).all() and pool.valid[1].sum() == 3
    assert pool.preallocate(6, 600, budget_bytes=10 ** 9) == 1000  # never shrinks
    assert pool.preallocate(6, 5000, budget_bytes=10 ** 9) == 5000  # all that was asked
    fresh = HeadCachePool(2, 4, 5, 11, torch.float32, torch.device("cpu"))
    assert fresh.preallocate(8, 4096, budget_bytes=0) == MIN_CAPACITY  # no budget: as made
    fresh.reserve(8, 700)
    assert fresh.capacity == 4 * MIN_CAPACITY


def test_fused_projections_share_the_heads_memory():
    """The runtime's fused q/k/v and gate/up weights are the head's
    parameters (views into one tensor each), not copies: an 8B-shaped head
    would otherwise hold 330 MB twice."""
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    head = _gqa_head(seed=7)
    want = {name: p.detach().clone() for name, p in head.named_parameters()}
    layer = HeadRuntime(head, torch.nn.Embedding(50, 32)).layer
    attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
    assert attn.q_proj.weight.data_ptr() == layer.qkv_weight.data_ptr()
    assert mlp.gate_proj.weight.data_ptr() == layer.gate_up_weight.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == \
        layer.qkv_weight.untyped_storage().data_ptr()
    for name, p in head.named_parameters():  # every value kept
        assert torch.equal(p, want[name]), name


def test_graphs_replayed_lately_are_kept_and_captures_in_service_are_counted(monkeypatch,
                                                                             caplog):
    """Past `MAX_GRAPHS` the graph replayed least recently goes, not the one
    captured first (start-up's step graphs are the oldest and the most used:
    dropped first, each would stall a step again, 10-960 ms on the H200,
    docs/results/batch_draft_length_h200_run11). A capture after start-up's
    is counted and logged: the first `SERVICE_LOG_FIRST`, then one in
    `SERVICE_LOG_EVERY`."""
    from types import SimpleNamespace

    from vllm_specplug.proposers import head_graphs
    from vllm_specplug.proposers.head_graphs import PassGraphs, _Captured

    captured = []

    def capture_graph(self, key, run_pass, inputs, constants, own_inputs):
        captured.append(key)  # no CUDA here: a graph whose replay does nothing
        return _Captured(SimpleNamespace(replay=lambda: None), list(inputs), key)

    monkeypatch.setattr(PassGraphs, "_capture_graph", capture_graph)
    monkeypatch.setattr(head_graphs, "MAX_GRAPHS", 3)
    graphs, x = PassGraphs(), [torch.zeros(1)]
    for key in ("a", "b", "c", "a", "d", "a", "b"):
        assert graphs.run(0, (key,), None, x) == (True, (key,))
    # b went for d (a had been replayed since), then c for b
    assert captured == [("a",), ("b",), ("c",), ("d",), ("b",)]
    assert list(graphs.graphs) == [("d",), ("a",), ("b",)]
    assert graphs.service_captures()["num_captures"] == 0  # start-up's
    graphs.in_service = True
    for i in range(2 * head_graphs.SERVICE_LOG_EVERY):
        graphs.run(0, ("step", i), None, x)
    stats = graphs.service_captures()
    assert stats["num_captures"] == 2 * head_graphs.SERVICE_LOG_EVERY and stats["num_graphs"] == 3
    logged = [r for r in caplog.records if "in service" in r.getMessage()]
    assert len(logged) == head_graphs.SERVICE_LOG_FIRST + 2
