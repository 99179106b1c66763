"""`SpecplugV2HeadSpeculator`'s chain and tree drafts, through its own step path on
CPU (`tests/v2_head_driver.py`: a step of prefills, then decode steps as
Model Runner V2 hands them over, verified greedily against the target's
continuations), equal the drafts of a plain `HeadRuntime` fed the same
verified positions step by step: new requests, the prefills' ingest, the
fused decode step's verified rows and its one pass lose nothing of the
head's drafting. The built-in model and head in float32, where both paths
run the same operations.

Why: on the H200 our chain's τ on SmolLM2 fell under vLLM's `eagle3` with
the same head, and tree 16's under its own of a week before (docs/results/smollm2_sets_large_h200). This test clears the
speculator's host-side layout of the step; the drafting's GPU paths are
`tests/gpu/test_head_acceptance_cuda.py`'s."""
from __future__ import annotations

import pytest

from tests.scripts import benchmark_script


@pytest.fixture(scope="module")
def continuations(tiny_model_dir, tiny_eagle3_dir):
    """The built-in model's greedy answers to 5 held-out prompts, 64 tokens."""
    from vllm_specplug.cli.bench_inputs import load_prompts
    from vllm_specplug.draft_models.eagle3_model import Eagle3Head

    script = benchmark_script("offline_head_acceptance")
    aux_ids = Eagle3Head.from_pretrained(tiny_eagle3_dir).config.aux_layer_ids
    return script.continuations(str(tiny_model_dir), load_prompts("held-out", 5),
                                aux_ids, 64, "cpu")


CHAIN = {"topk": 1, "num_steps": 5}
TREE = {"topk": 4, "num_steps": 4, "num_draft_tokens": 16, "draft_temperature": 0.25}


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree16"])
def test_the_v2_speculators_drafts_equal_the_plain_runtimes(continuations, tiny_eagle3_dir,
                                                            spec):
    """Chains, and trees (verified along the accepted path that the tree
    sampler would write, `TreeSlots.accepted_nodes`): same tokens, same
    parents, step by step."""
    from tests.v2_head_driver import HeadEngine, Turn

    found, embed = continuations
    engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                        embed.num_embeddings, found, spec)
    engine.serve([Turn(r, f"r{r}", c.prompt_len, len(c.token_ids))
                  for r, c in enumerate(found)])
    assert engine.num_steps > 5 * 64 // 8  # decode steps of every request
    assert engine.num_differing == 0, engine.num_differing
    assert (engine.accepted == engine.reference_accepted).all()
    # drafts that count: the built-in head on its own model's text
    assert 1 + engine.accepted.sum() / engine.num_steps > 2.5


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["fresh", "next-turn"])
def test_a_prefill_split_over_two_steps_drafts_from_its_whole_prompt(
        continuations, tiny_eagle3_dir, prefix_caching):
    """vLLM's chunked prefill: each prompt's first positions in a step of
    their own (no token sampled: the next prompt token follows its last row,
    its last sample is stale), the rest in the next. The drafts after it
    equal those of a runtime that ingested the whole prompt at once; with
    prefix caching, as a chat's next turn on the blocks the first left.
    Why: at batch 64 on the H100 our chain's first drafts were accepted 4-5%
    less than vLLM's, where at 16 (whose prompts fit one step) they were
    not (docs/results/smollm2_chains_b64_h100_s72)."""
    from tests.v2_head_driver import BLOCK_SIZE, HeadEngine, Turn

    found, embed = continuations
    engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                        embed.num_embeddings, found, CHAIN, prefix_caching=prefix_caching)
    turns = [Turn(r, f"a{r}", c.prompt_len, c.prompt_len + 32) for r, c in enumerate(found)]
    if prefix_caching:  # a first turn, unchunked, leaves its blocks
        engine.serve(turns)
        turns = []
        for r, c in enumerate(found):
            cached = min(int(engine.states.num_computed_tokens_np[r]), c.prompt_len + 39)
            turns.append(Turn(r, f"b{r}", c.prompt_len + 40, len(c.token_ids),
                              cached // BLOCK_SIZE * BLOCK_SIZE))
    steps = engine.num_steps
    engine.serve(turns, chunk=5)
    assert engine.num_steps > steps + len(found) * 4
    if prefix_caching:
        assert engine.speculator.prefix.num_adopted == len(found)
    assert engine.num_differing == 0, engine.num_differing


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree16"])
def test_prefills_beside_decodes_in_one_step_draft_as_alone(continuations, tiny_eagle3_dir,
                                                            spec):
    """A mixed step (a wave's second step at batch 64: prompts over the
    first step's token budget prefill while the first ones decode): the
    decodes' verified rows and the prefills' prompts go into the head in
    one step, and every request drafts what a runtime fed its own
    positions drafts, the step's and every later one's."""
    from tests.v2_head_driver import HeadEngine, Turn

    found, embed = continuations
    engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                        embed.num_embeddings, found, spec)
    turns = [Turn(r, f"r{r}", c.prompt_len, len(c.token_ids)) for r, c in enumerate(found)]
    engine.serve_beside(turns[:2], turns[2:])
    assert engine.num_steps > 5 * 64 // 8
    assert engine.num_differing == 0, engine.num_differing
    assert (engine.accepted == engine.reference_accepted).all()


def test_a_next_turn_on_cached_blocks_drafts_from_its_whole_context(continuations,
                                                                    tiny_eagle3_dir):
    """A chat's next turn: each sequence's first request decodes half its
    continuation and finishes; a second request of the same sequence, in the
    same state slot, starts on the blocks the first left (a prefix-cache
    hit). The speculator adopts the head's saved rows there
    (integration/v2/prefix_blocks.py), the prefix's last row included (the
    first request had the same token after it), and its drafts equal those
    of a runtime that ingested the whole prompt; without them (no saved
    rows: prefix blocks off, the target still starting at the hit) it drafts
    from the uncached suffix alone, and the drafts part."""
    from tests.v2_head_driver import BLOCK_SIZE, HeadEngine, Turn

    found, embed = continuations
    for adopt in (True, False):  # False: no saved rows, the target still starts at the hit
        engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                            embed.num_embeddings, found, {"topk": 1, "num_steps": 5},
                            prefix_caching=adopt)
        engine.serve([Turn(r, f"a{r}", c.prompt_len, c.prompt_len + 32)
                      for r, c in enumerate(found)])
        steps = engine.num_steps
        turns = []
        for r, c in enumerate(found):
            prompt = c.prompt_len + 40
            assert prompt + 16 < len(c.token_ids), "the model's answer ended early (EOS)"
            cached = min(int(engine.states.num_computed_tokens_np[r]), prompt - 1)
            turns.append(Turn(r, f"b{r}", prompt, len(c.token_ids),
                              cached // BLOCK_SIZE * BLOCK_SIZE))
        engine.serve(turns)
        assert all(t.hit >= BLOCK_SIZE for t in turns)
        assert engine.num_steps > steps
        if adopt:
            assert engine.speculator.prefix.num_adopted == len(found)
            assert engine.num_differing == 0, engine.num_differing
        else:
            assert engine.num_differing > 0


def test_a_repeated_prompt_on_cached_blocks_drafts_as_the_first_time(continuations,
                                                                     tiny_eagle3_dir):
    """The same prompts again, each on the blocks its first run left (what
    `bench` repeats and a shared prompt do): the adopted prefix keeps its
    last row, computed with the token the repeat has there too, so every
    step drafts what the first run drafted (with that row left out, as
    before, 11 of 86 steps drafted otherwise and τ fell from 3.43 to 3.31)."""
    from tests.v2_head_driver import BLOCK_SIZE, HeadEngine, Turn

    found, embed = continuations
    engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                        embed.num_embeddings, found, {"topk": 1, "num_steps": 5},
                        prefix_caching=True)
    runs = []
    for run in range(2):
        accepted, steps = engine.accepted.copy(), engine.num_steps
        engine.serve([Turn(r, f"r{r}-{run}", c.prompt_len, len(c.token_ids),
                           (c.prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE if run else 0)
                      for r, c in enumerate(found)])
        runs.append((engine.num_steps - steps, (engine.accepted - accepted).tolist()))
    assert engine.speculator.prefix.num_adopted == len(found)
    assert engine.num_differing == 0, engine.num_differing
    assert runs[0] == runs[1], runs


def test_requests_hitting_blocks_filled_beside_them_draft_from_their_whole_context(
        continuations, tiny_eagle3_dir):
    """A burst on one prompt (`n` > 1 samples, a shared system prompt): the
    first request fills the prompt's blocks, and the others, in the same
    step, start on them as a prefix-cache hit (vLLM caches a block once it
    is scheduled). No saved rows exist yet, so they cannot adopt; after
    the step's prefill ingest they take the first request's rows and ingest
    their last prefill row again (`PrefixBlocks.fill_missed`), and every
    step drafts what a runtime that ingested the whole prompt drafts.
    Before that they drafted from their uncached suffix alone (4 of 18
    steps drafted otherwise here)."""
    from tests.v2_head_driver import BLOCK_SIZE, HeadEngine, Turn

    found, embed = continuations
    same = [found[0]] * 3  # three slots of one sequence
    engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                        embed.num_embeddings, same, {"topk": 1, "num_steps": 5},
                        prefix_caching=True)
    prompt = same[0].prompt_len
    hit = (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert hit >= BLOCK_SIZE
    first_logits = []  # the slots' first drafts' logits: from each one's last prefill row

    def after_prefill():
        pool = engine.speculator.runtime.pool
        first_logits.extend((pool.last_logits[r] - pool.last_logits[0]).abs().max().item()
                            for r in (1, 2))

    engine.serve([Turn(0, "a", prompt, prompt + 24)]
                 + [Turn(r, f"b{r}", prompt, prompt + 24, hit, blocks_from=0) for r in (1, 2)],
                 after_prefill)
    assert engine.speculator.prefix.stats()["filled"] == 2
    assert engine.num_differing == 0, engine.num_differing
    # that row ingested again over the whole prefix: the first request's, to
    # float32 rounding (other batch shapes); from the uncached suffix alone
    # it differed by 0.42
    assert max(first_logits) < 1e-4, first_logits


def test_draft_attention_reaches_the_heads_runtime(continuations, tiny_eagle3_dir):
    """`draft_attention` is the attention path of the runtime the speculator
    drafts with (here "torch", the PyTorch path the reference runs on CPU)."""
    from tests.v2_head_driver import HeadEngine, Turn

    found, embed = continuations
    engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                        embed.num_embeddings, found[:2],
                        {"topk": 1, "num_steps": 5, "draft_attention": "torch"})
    assert engine.speculator.runtime.attention_backend == "torch"
    engine.serve([Turn(r, f"r{r}", c.prompt_len, c.prompt_len + 24)
                  for r, c in enumerate(found[:2])])
    assert engine.num_steps > 0 and engine.num_differing == 0


# a lookup's branch reaching below the tree (prompt_lookup_tokens > num_steps):
# the verified rows are sized by the deeper of the two (`verified_depth`)
DEEP_TREE = {**TREE, "prompt_lookup_tokens": 7}


@pytest.mark.parametrize("shape", [CHAIN, TREE, DEEP_TREE], ids=["chain", "tree", "deep-tree"])
def test_prompt_lookups_draft_where_the_history_repeats(continuations, tiny_eagle3_dir,
                                                        shape):
    """`prompt_lookup_min` (proposers/lookup.py) on V2's two step kinds, the
    mixed step (drafted apart) and the fused decode step (its graph's
    drafts): each step's chain is the reference runtime's, or the n-gram
    selection's where the history has one with K tokens after it; each
    step's tree is the reference's with that selection grafted as a branch
    (tokens and stored parents both)."""
    from tests.v2_head_driver import HeadEngine, Turn

    found, embed = continuations
    engine = HeadEngine(str(tiny_eagle3_dir), lambda ids: embed(ids.long()),
                        embed.num_embeddings, found, {**shape, "prompt_lookup_min": 3})
    turns = [Turn(r, f"r{r}", c.prompt_len, len(c.token_ids)) for r, c in enumerate(found)]
    engine.serve_beside(turns[:2], turns[2:])
    assert engine.num_differing == 0, engine.num_differing
    assert 0 < engine.num_looked_up < engine.num_steps, engine.num_looked_up  # both kinds
    assert engine.speculator.lookup.stats()["lookup_rows"] == engine.num_looked_up
    if shape is not CHAIN:  # some lookups were in the tree already, some grafted
        depth = engine.speculator.drafter.options.lookup_num_tokens
        assert 0 < engine.speculator.lookup.stats()["lookup_nodes"] < engine.num_looked_up * depth
    assert (engine.accepted == engine.reference_accepted).all()
    if shape is DEEP_TREE:  # accepted paths reached below the head's depth
        assert engine.accepted[TREE["num_steps"]:].sum() > 0, engine.accepted
