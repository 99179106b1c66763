"""Tree EAGLE on a CUDA GPU (issues 15, 26): `specplug_eagle3` chains and
trees run on Model Runner V2 with async scheduling (`SpecplugV2HeadSpeculator`),
our tree attention runs in vLLM's CUDA attention backend inside captured
graphs, and the output equals no speculation. The benchmark is `vllm-specplug
bench offline` (docs/results/); this is the regression check.

Run on the staged GPU host (docs/gpu.md) with the tiny model, its head and
prompts in `$SPECPLUG_GPU_WORK` (`bench_model_runner_v2.py prepare` and
`bench_tree_cuda.py prepare`). CI has no GPU: skipped there, with the reason.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_v2 import (NUM_SAMPLED, SAMPLING, V2_RUNNER,  # noqa: F401
                                            _engine, _outputs, baseline, prompts, sampled,
                                            work)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (tree attention in vLLM's CUDA backends); run on the staged "
           "GPU host as docs/gpu.md says")

TREE = {"method": "specplug_eagle3", "topk": 4, "num_steps": 4, "num_draft_tokens": 16,
        "draft_temperature": 0.25}
CHAIN = {"method": "specplug_eagle3", "topk": 1, "num_steps": 5, "num_draft_tokens": 6}
# vLLM's dynamic speculative decoding: 5 drafts up to 4 requests, 2 beyond;
# the tree: 15 drafts (16 nodes) up to 4 requests, 5 beyond. As the batch
# drains, steps verify more rows than the last, smaller tree had (their
# rows hold stale drafts: verification must stop at the drafted nodes)
SIZED_CHAIN = {**CHAIN, "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 1024, 2]]}
SIZED_TREE = {**TREE, "num_speculative_tokens_per_batch_size": [[1, 4, 15], [5, 1024, 5]]}
# vLLM's adaptive verification over our chain's confidences (issue 27)
ADAPTIVE_CHAIN = {**CHAIN, "enable_adaptive_verification": True}
# prompt lookups in place of chains where the history repeats (proposers/lookup.py:
# the n-gram kernels after the fused step's graph)
LOOKUP_CHAIN = {**CHAIN, "prompt_lookup_min": 3}
# ... and as a branch of each tree (the graft writes the stored trees after the graph),
# reaching below the head's 4 levels (verified rows sized by `verified_depth`)
LOOKUP_TREE = {**TREE, "prompt_lookup_min": 3, "prompt_lookup_tokens": 8}
SPECS = {"tree": TREE, "chain": CHAIN, "chain-sized": SIZED_CHAIN, "tree-sized": SIZED_TREE,
         "chain-adaptive": ADAPTIVE_CHAIN, "chain-lookup": LOOKUP_CHAIN,
         "tree-lookup": LOOKUP_TREE}
# accepted tokens per drafting step a trained head reaches on held-out
# prompts (measured on the V1 runner: tree 16 2.86, chain K=5 2.06)
MIN_ACCEPTED = {"tree": 2.0, "chain": 1.5, "chain-sized": 1.3, "tree-sized": 1.5,
                "chain-adaptive": 1.3, "chain-lookup": 1.5, "tree-lookup": 2.0}


@pytest.fixture(scope="module", params=list(SPECS))
def tree_run(request, work, prompts):  # noqa: F811
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    head = work / "tiny-eagle3"
    if not (head / "model.safetensors").exists():
        pytest.skip(f"{head} missing: run bench_tree_cuda.py prepare")
    spec = SPECS[request.param]
    llm = _engine(work, {**spec, "model": str(head)}, dtype="float32", cudagraph_metrics=True,
                  compilation_config={"max_cudagraph_capture_size": 1024})
    try:
        llm.collective_rpc("specplug_record_cudagraph_modes")
        at_start = llm.collective_rpc("specplug_head_pool_state")[0]
        outputs = _outputs(llm, prompts)
        outputs["graphs"] = llm.collective_rpc("specplug_cudagraph_modes")[0]
        counts = read_spec_decode_counts(llm)
        state = llm.collective_rpc("specplug_tree_attention_state")[0]
        runner = llm.collective_rpc("specplug_runner_state")[0]
        runner["adaptive"] = llm.collective_rpc("specplug_adaptive_verification_state")[0]
        runner["pool"] = llm.collective_rpc("specplug_head_pool_state")[0]
        runner["pool_at_start"] = at_start
        outputs["sampled"] = [sampled(llm, prompts[:NUM_SAMPLED]) for _ in range(2)]
        yield request.param, outputs, counts, state, runner
    finally:
        shutdown_llm(llm)


def test_seeded_sampling_reproduces_its_output(tree_run, baseline, prompts):  # noqa: F811
    """Seeded sampling: the same seed, the same tokens. Trees go further:
    vLLM's sampler draws the target's token at every node (its Gumbel noise
    keyed by seed and position) and the walk keeps the draws, so a seeded
    request gets no speculation's own tokens, whatever the tree's size or
    the batch (chains use vLLM's rejection sampler, which does not). The one
    exception is the GPU's near-tie: where a request's tokens first differ,
    no speculation's Gumbel-max choice led the tree's token by less than
    NEAR_TIE_GAP (`compare.sampled_divergences`, vLLM's noise recomputed),
    which other kernels' rounding may flip, as for greedy."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, sampled_divergences

    kind, outputs, _, _, _ = tree_run
    first, second = outputs["sampled"]
    assert first == second
    assert first != [b[:32] for b in outputs["batched"][:NUM_SAMPLED]]  # sampled, not greedy
    if kind.startswith("tree"):
        found = sampled_divergences(
            baseline["sampled"], first, baseline["sampled_logprobs"],
            [len(p["prompt_token_ids"]) for p in prompts[:NUM_SAMPLED]], SAMPLING["seed"],
            SAMPLING["temperature"], SAMPLING["top_p"])
        print("seeded divergences (no speculation vs tree):", found)
        assert all(-NEAR_TIE_GAP < d["gap"] < NEAR_TIE_GAP for d in found) and len(found) <= 1, \
            found


def test_eagle3_runs_on_model_runner_v2_with_async_scheduling(tree_run):
    kind, _, _, _, runner = tree_run
    assert runner["runner"] == V2_RUNNER, runner
    assert runner["speculator"] == "SpecplugV2HeadSpeculator", runner
    assert runner["async_scheduling"], runner
    # prompt lookups scan every history each step: in GPU memory (token_history.py)
    assert runner["token_history"] == ("device" if kind.endswith("lookup") else "host"), runner
    # the head's pool was sized at load for every request's whole length (the
    # tiny model's fit the budget): it never grew in service (one allocation
    # after the first, version 1), so no graph of the head was captured twice
    pool = runner["pool"]
    assert pool["capacity"] >= pool["max_positions"] and pool["version"] == 1, pool


def test_the_head_captures_its_step_graphs_at_start_up(tree_run):
    """Model Runner V2's `capture()` captured the fused decode step for every
    padded batch size and every length the config may schedule, and where a
    table's length changes with the batch, the steps between two lengths
    (integration/v2/step_warmup.py), for the target layout service then
    used: every steady shape has its graph before the first request, and
    generating captured none (a wrong guess of the layout would add a second
    set, captured on first use). vLLM's own dummy runs may add graphs of
    other shapes at start-up: those are listed, not counted against it."""
    from vllm_specplug.integration.batch_schedule import table_lengths
    from vllm_specplug.integration.v2.head_speculator import step_tree_shape
    from vllm_specplug.integration.v2.step_warmup import step_keys

    kind, _, _, _, runner = tree_run
    spec = SPECS[kind]
    table = spec.get("num_speculative_tokens_per_batch_size")
    lengths = table_lengths(table) if table else (spec["num_draft_tokens"] - 1,)
    shape = (spec["topk"], spec["num_steps"], spec["num_draft_tokens"])
    start, after = runner["pool_at_start"], runner["pool"]
    expected = {(size, num_rows, tuple(tree)) for size, num_rows, tree
                in step_keys(lengths, table, shape, step_tree_shape, start["max_num_reqs"])}
    at_start, in_service = _step_keys(start), _step_keys(after)
    assert expected <= {key[:2] + key[3:] for key in at_start}, (
        sorted(expected - {key[:2] + key[3:] for key in at_start}), start)
    assert in_service == at_start, sorted(in_service - at_start)
    assert len(start["step_layouts"]) == 1 and after["step_layouts"] == start["step_layouts"], (
        start, after)


def _step_keys(pool_state: dict) -> set[tuple]:
    """(padded batch, rows, key range, tree shape) of each step graph (the
    probe's lists made hashable)."""
    return {(size, rows, keys, tuple(tree)) for size, rows, keys, tree in pool_state["step_keys"]}


def test_tree_attention_runs_in_the_cuda_backend(tree_run):
    kind, _, _, state, _ = tree_run
    if kind.startswith("chain"):  # chains verify causally: no tree attention at all
        assert not state["active"], state
        return
    assert state["active"] and state["impl"] == "TritonAttentionImpl", state
    assert state["masked_steps"] > 0, state


def test_tree_eagle_is_lossless_on_cuda(tree_run, baseline):  # noqa: F811
    """Alone: token for token. Batched: token for token except flips of the
    baseline's own fp32 near-ties, as for every method (test_model_runner_v2)."""
    from vllm_specplug.bench.compare import NEAR_TIE_GAP, divergences

    kind, outputs, counts, _, _ = tree_run
    alone = [i for i, (a, b) in enumerate(zip(baseline["alone"], outputs["alone"])) if a != b]
    assert not alone, alone
    found = divergences(baseline["batched"], outputs["batched"], baseline["gaps"])
    assert all(d["gap"] < NEAR_TIE_GAP for d in found) and len(found) <= 2, found
    # a trained head on held-out prompts accepts several tokens a step
    assert counts.num_drafts, counts
    assert counts.num_accepted_tokens > MIN_ACCEPTED[kind] * counts.num_drafts, counts
    if kind == "chain-sized":  # alone: 5 drafts a step; batched: 2 while over 4 requests run
        assert 2 < counts.num_draft_tokens / counts.num_drafts < 5, counts
    if kind == "tree-sized":  # alone: 15 drafts a step; batched: 5 while over 4 requests run
        assert 5 < counts.num_draft_tokens / counts.num_drafts < 15, counts


@pytest.mark.parametrize("tree_run", ["chain-adaptive"], indirect=True)
def test_adaptive_verification_ranks_our_chains_drafts(tree_run):
    """With `enable_adaptive_verification`, vLLM made its manager for our
    speculator, and our drafting pass fed vLLM's estimator for every request
    it drafted for (losslessness: test_tree_eagle_is_lossless_on_cuda)."""
    adaptive = tree_run[4]["adaptive"]
    assert adaptive["manager"] and adaptive["estimator"], adaptive
    assert adaptive["slots_with_features"] >= 8, adaptive


@pytest.mark.parametrize("tree_run", ["tree-sized"], indirect=True)
def test_sized_trees_replay_full_graphs_at_each_size(tree_run):
    """vLLM captures decode graphs for every query length of the table; the
    6-node tier's uniform decode steps (5+ requests, 6 tokens each) replay
    them. (A GPU run found that tier's forward at 66 launches a step.)"""
    kind, outputs, _, _, _ = tree_run
    assert kind == "tree-sized"
    graphs = outputs["graphs"]
    # 6-token decode steps of 5+ requests; 48 could also be 3 requests of 16
    tier = [g for g in graphs if g["num_tokens"] % 6 == 0 and g["num_tokens"] >= 30
            and g["num_tokens"] != 48]
    full = sum(g["count"] for g in tier if "FULL" in str(g["mode"]))
    total = sum(g["count"] for g in tier)
    assert total and full >= 0.8 * total, graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_drafting_equals_eager_drafting(dtype):
    """The runtime's captured drafting passes (run at the pool's whole
    capacity: the kernel stops at the rows' positions) give the trees the
    same pass gives eagerly at the tight keys bucket, at batch sizes that pad (3 -> 4, 9 ->
    16) and share a graph (3 and 4), and after the pool grows (its tensors
    move: the graphs must be captured again, not replayed on stale memory)."""
    from tests.test_tree_eagle_unit import _gqa_head
    from vllm_specplug.proposers.draft_layers import cast_parameters
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.head_graphs import keys_bucket

    head = cast_parameters(_gqa_head().cuda(), dtype)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 32).cuda()
    graphed = HeadRuntime(head, embed, num_slots=4, cuda_graphs=True)

    def ingest(req_ids, length):
        for req_id in req_ids:
            graphed.ingest(req_id, torch.randn(length, 48, device="cuda"),
                           torch.randint(0, 50, (length,), device="cuda"),
                           torch.arange(length, device="cuda"))

    def check(req_ids, length):
        batch = len(req_ids)
        roots = torch.randint(0, 50, (batch,), device="cuda")
        positions = torch.full((batch,), length, device="cuda")
        tree = graphed.draft_trees(req_ids, roots, positions, 4, 4, 16)
        token_ids, parent_ids = tree.token_ids.clone(), tree.parent_ids.clone()
        slots = torch.tensor([graphed.pool.slot_of[r] for r in req_ids], device="cuda")
        want = graphed._draft_pass(slots, roots, positions,
                                   keys_bucket(length, graphed.pool.capacity), 4, 4, 16)
        assert torch.equal(token_ids, want.token_ids) and torch.equal(parent_ids,
                                                                      want.parent_ids)

    ids = [f"r{i}" for i in range(9)]
    ingest(ids, 40)
    for batch in (1, 3, 4, 9):
        check(ids[:batch], 40)
    assert not graphed.graphs.disabled and len(graphed.graphs.keys("draft")) == 3  # 1, 4, 16
    version = graphed.pool.version
    ingest(ids[:3], 300)  # past the first capacity: the pool is reallocated
    assert graphed.pool.version > version
    check(ids[:3], 300)
    assert not graphed.graphs.disabled and len(graphed.graphs.keys("draft")) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_decode_ingest_equals_the_padded_pass_run_eagerly(dtype):
    """Decode ingests replayed from captured graphs leave every cache (K/V,
    validity, last output and logits) bit-equal to the same padded pass run
    eagerly, across batch padding, row buckets and a re-ingest; and close to
    the ragged eager ingest (tests/test_tree_eagle_unit.py checks the
    padded pass against it on CPU)."""
    from tests.test_tree_eagle_unit import _decode_ingests, _gqa_head
    from vllm_specplug.proposers.draft_layers import cast_parameters
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    head = cast_parameters(_gqa_head(seed=6).cuda(), dtype)
    embed = torch.nn.Embedding(50, 32).cuda()
    graphed = HeadRuntime(head, embed, num_slots=2, cuda_graphs=True)
    eager = HeadRuntime(head, embed, num_slots=2, cuda_graphs=True)
    eager.graphs.disabled = {"ingest"}  # the same padded pass, eagerly
    for runtime in (graphed, eager):
        _decode_ingests(_OnCuda(runtime))
    assert not graphed.graphs.disabled and len(graphed.graphs.keys("ingest")) == 4
    for name in ("keys", "values", "valid", "last_out", "last_logits"):
        assert torch.equal(getattr(graphed.pool, name), getattr(eager.pool, name)), name


@pytest.mark.parametrize("shape", [(1, 5, 6), (4, 4, 16)])
def test_graphed_fused_step_reads_its_buffers_in_place(shape):
    """The fused decode step (ingest + drafting, one replay) reads the
    speculator's persistent buffers where they are: three steps that rewrite
    the same buffers give caches and drafts bit-equal to the same pass run
    eagerly, from one captured graph."""
    from tests.test_v2_tree_unit import _fused_step_runtimes

    runtimes, step = _fused_step_runtimes(seed=4, device="cuda", cuda_graphs=(True, False))
    buffers = {name: value.clone() for name, value in step.items()}
    # what the pass emits goes to a persistent tensor, as the speculator's drafts
    # do: a replay runs the captured kernels, not the Python that recorded them
    emitted = [torch.zeros(4, shape[2], dtype=torch.int64, device="cuda") for _ in range(2)]
    drafts = [[], []]
    for k in range(3):  # each step verifies 4 more positions per request
        for name, value in step.items():
            fresh = value + 4 * k if name in ("positions", "cuts", "root_positions") else value
            if name == "next_token_ids":
                fresh = (value + 7 * k) % 50
            buffers[name].copy_(fresh)
        for runtime, out, seen in zip(runtimes, emitted, drafts):
            runtime.decode_step(*buffers.values(), 64, shape,
                                lambda slots, tree, out=out: out.copy_(tree.token_ids))
            seen.append(out.clone())
    graphed, eager = runtimes
    assert not graphed.graphs.disabled and len(graphed.graphs.keys("step")) == 1
    for got, want in zip(*drafts):
        assert torch.equal(got, want)
    assert not torch.equal(drafts[0][0], drafts[0][2])  # the steps differ
    for name in ("keys", "values", "valid", "last_out", "last_logits"):
        assert torch.equal(getattr(graphed.pool, name), getattr(eager.pool, name)), name


class _OnCuda:
    """A runtime whose ingest inputs (built on the CPU) move to CUDA."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime

    def ingest(self, req_id, hidden, token_ids, positions):
        self.runtime.ingest(req_id, hidden.cuda(), token_ids.cuda(), positions)

    def ingest_many(self, req_ids, hidden, token_ids, positions, counts):
        self.runtime.ingest_many(req_ids, hidden.cuda(), token_ids.cuda(), positions, counts)


def test_split_tree_attention_serves_bf16_trees(work, prompts):  # noqa: F811
    """In bf16 vLLM picks FlashAttention 3 (fp32 runs the Triton backend):
    there tree steps take the split way (FlashAttention over the prefix, our
    tree part merged by log-sum-exp) unless `tree_attention="rewrite"`. Both
    ways compute the same attention, so the trees accept as much; a wrong
    merge or mask would show as lost acceptance. (Per layer, the split way
    is checked against the float32 reference in
    tests/kernels/test_tree_attention_split.py.)"""
    from vllm_specplug.engine import shutdown_llm
    from vllm_specplug.metrics import read_spec_decode_counts

    head = work / "tiny-eagle3"
    if not (head / "model.safetensors").exists():
        pytest.skip(f"{head} missing: run bench_tree_cuda.py prepare")
    runs = {}
    for way in ("split", "rewrite"):
        llm = _engine(work, {**TREE, "model": str(head), "tree_attention": way},
                      dtype="bfloat16")
        try:
            outputs = _outputs(llm, prompts)
            counts = read_spec_decode_counts(llm)
            state = llm.collective_rpc("specplug_tree_attention_state")[0]
        finally:
            shutdown_llm(llm)
        assert state["impl"] == "FlashAttentionImpl", state
        runs[way] = (outputs, counts.num_accepted_tokens / counts.num_drafts, state)
    (split, split_accepted, split_state), (_, rewrite_accepted, rewrite_state) = \
        runs["split"], runs["rewrite"]
    assert split_state["split_layers"] > 0 and rewrite_state["split_layers"] == 0
    assert split_accepted > MIN_ACCEPTED["tree"], split_accepted
    assert split_accepted > 0.9 * rewrite_accepted, (split_accepted, rewrite_accepted)
