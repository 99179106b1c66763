"""Model Runner V2's heads under structured outputs (issue 30), on CPU:
`SpecplugV2HeadSpeculator` ranks each drafting step of a structured request
among the tokens its grammar allows on that node's path, and drafts the free
requests of the same batch as before. Model Runner V2 needs CUDA: here its
`req_states` and `input_batch` are stand-ins with the fields the speculator
reads, the head is a random one on the CPU, and the grammar is vLLM's own
manager on the tiny model's tokenizer. The engine test is
tests/gpu/test_grammar_trees_cuda.py."""
from __future__ import annotations

import time
from types import MethodType, SimpleNamespace

import numpy as np
import torch

from vllm_specplug.integration.guard import ProposerGuard
from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
from vllm_specplug.integration.v2.structured import StructuredRequests

ONE = 22  # "1" in the tiny model's tokenizer
PROMPT_LEN = 10
TREE = (4, 4, 16)  # topk, num_steps, num_draft_tokens


def _structured(tiny_model_dir) -> StructuredRequests:
    """Requests "digits" (regex [0-9]+) and "free", scheduled; the grammar
    compiled (on the manager's threads)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tokenizers.registry import cached_tokenizer_from_config

    config = EngineArgs(model=str(tiny_model_dir), max_model_len=512).create_engine_config()
    digits = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    digits.verify(config.model_config, None, config.structured_outputs_config,
                  cached_tokenizer_from_config(config.model_config))
    structured = StructuredRequests(config)
    structured.schedule(SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[
        SimpleNamespace(req_id="digits", sampling_params=digits),
        SimpleNamespace(req_id="free", sampling_params=SamplingParams())]))
    structured.grammar("digits", np.zeros(0, dtype=np.int32))
    holder = structured.grammars.tracked["digits"].holder.structured_output_request
    deadline = time.monotonic() + 60
    while holder.grammar is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return structured


def _speculator(structured: StructuredRequests):
    """The fields of `SpecplugV2HeadSpeculator` that `_grammar_masks` and
    `_draft` read: two requests in slots 0 and 1, each with a 10-token
    prompt cached in the head and "1" sampled after it."""
    from tests.test_tree_eagle_unit import _gqa_head
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    generator = torch.Generator().manual_seed(5)
    embed = torch.nn.Embedding(50, 32, _weight=torch.randn(50, 32, generator=generator))
    runtime = HeadRuntime(_gqa_head(5), embed)
    runtime.make_pool(2, torch.float32, "cpu")
    runtime.ingest_slots(np.array([0, 1]), np.ones(2, dtype=bool),
                         torch.randn(2 * PROMPT_LEN, 48, generator=generator),
                         torch.randint(0, 50, (2 * PROMPT_LEN,), generator=generator),
                         np.tile(np.arange(PROMPT_LEN), 2), [PROMPT_LEN, PROMPT_LEN])
    all_token_ids = torch.zeros(2, 64, dtype=torch.int64)
    all_token_ids[:, PROMPT_LEN] = ONE
    req_states = SimpleNamespace(
        total_len=SimpleNamespace(gpu=torch.tensor([PROMPT_LEN + 1] * 2)),
        prompt_len=SimpleNamespace(np=np.array([PROMPT_LEN] * 2)),
        all_token_ids=SimpleNamespace(gpu=all_token_ids))
    speculator = SimpleNamespace(
        structured=structured, runtime=runtime, req_states=req_states,
        device=torch.device("cpu"), root_masks=None, max_num_reqs=2, grammar_choices=None,
        vllm_config=structured.grammars.vllm_config,
        guard=ProposerGuard("specplug_eagle3", 8), tree_slots=None, rows_in_worker=False,
        drafter=SimpleNamespace(options=SimpleNamespace(masks_drafts=lambda: True)),
        drafts=torch.zeros(2, TREE[2] - 1, dtype=torch.int64))
    speculator._load_root_masks = MethodType(SpecplugV2HeadSpeculator._load_root_masks,
                                             speculator)
    return speculator


def _batch(has_structured: bool = True):
    return SimpleNamespace(num_reqs=2, req_ids=["digits", "free"],
                           idx_mapping=torch.tensor([0, 1]), idx_mapping_np=np.array([0, 1]),
                           has_structured_output_reqs=has_structured,
                           seq_lens_cpu_upper_bound=np.array([PROMPT_LEN + 4] * 2))


def _draft(speculator, masks) -> list[set[int]]:
    """Each request's drafted tokens (16-node trees after "1")."""
    SpecplugV2HeadSpeculator._draft(speculator, _batch(), torch.tensor([ONE, ONE]), 16,
                                    speculator.drafts, TREE, masks)
    return [set(row.tolist()) for row in speculator.drafts]


def test_a_structured_requests_tree_holds_only_what_its_grammar_allows(tiny_model_dir):
    """After "1" under [0-9]+, every node of the "digits" tree is a digit or
    the end of the output (each node's path stays in the grammar: digits
    after digits), where the same head drafts other tokens unmasked; the
    free request's tree is the one it drafts without masks; the grammar
    stays where the output is (the masks roll their paths back)."""
    structured = _structured(tiny_model_dir)
    speculator = _speculator(structured)
    masks = SpecplugV2HeadSpeculator._grammar_masks(speculator, _batch())
    assert masks is not None and speculator.guard.num_failures == 0
    grammar = structured.grammars.tracked["digits"].holder.structured_output_request.grammar
    bitmask = structured.grammars.manager.backend.allocate_token_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    allowed = {t for t in range(50) if (int(bitmask[0, t >> 5]) >> (t & 31)) & 1}
    assert ONE in allowed and len(allowed) < 20  # digits (and the end): a real constraint
    unmasked = _draft(speculator, None)
    masked = _draft(speculator, masks)
    assert unmasked[0] - allowed, "the head drafts other tokens unmasked: the test tests nothing"
    assert masked[0] <= allowed, masked[0] - allowed
    assert masked[1] == unmasked[1]
    assert structured.grammars.tracked["digits"].num_accepted == 1
    assert speculator.runtime.tree_logits_hook is None


def test_no_masks_without_structured_requests_in_the_batch(tiny_model_dir):
    """A batch vLLM marks as free (or a speculator with no structured
    request) drafts in one fused pass: no masks, no sync."""
    structured = _structured(tiny_model_dir)
    speculator = _speculator(structured)
    assert SpecplugV2HeadSpeculator._grammar_masks(speculator, _batch(False)) is None
    structured.schedule(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids={"digits"}))
    assert SpecplugV2HeadSpeculator._grammar_masks(speculator, _batch()) is None


def _allowed_after_one(structured) -> set[int]:
    """The tiny model's tokens "digits" may take after "1" under [0-9]+."""
    grammar = structured.grammars.tracked["digits"].holder.structured_output_request.grammar
    bitmask = structured.grammars.manager.backend.allocate_token_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    return {t for t in range(50) if (int(bitmask[0, t >> 5]) >> (t & 31)) & 1}


def _children(tree, row: int) -> set[int]:
    """Target ids of the root's children in a drafted tree's row."""
    depth_one = tree.depths[row] == 1
    return set(tree.token_ids[row][depth_one].tolist())


def test_first_step_masks_load_rows_and_mask_the_roots_children_in_the_pass(tiny_model_dir):
    """grammar_drafts "first" (`root_masks`): the batch's rows go into the
    persistent bitmask, the pass runs without a hook (graphable), the
    "digits" tree's depth-1 nodes are digits (or the end) where unmasked
    they are not, the free request's tree is unchanged; a batch without a
    grammar resets the rows."""
    structured = _structured(tiny_model_dir)
    speculator = _speculator(structured)

    def tree():
        return speculator.runtime.draft_slots(torch.tensor([0, 1]), torch.tensor([ONE, ONE]),
                                              torch.tensor([PROMPT_LEN] * 2), 16, *TREE)

    unmasked = tree()
    SpecplugV2HeadSpeculator._attach_root_masks(speculator)
    assert SpecplugV2HeadSpeculator._grammar_masks(speculator, _batch()) is None
    assert speculator.guard.num_failures == 0 and speculator.root_masks.num_masked_rows == 2
    assert speculator.runtime.tree_logits_hook is None  # the pass may replay a graph
    masked = tree()
    allowed = _allowed_after_one(structured)
    assert ONE in allowed and len(allowed) < 20
    assert _children(unmasked, 0) - allowed, "unmasked children are digits already: no test"
    assert _children(masked, 0) <= allowed, _children(masked, 0) - allowed
    assert torch.equal(masked.token_ids[1], unmasked.token_ids[1])
    assert structured.grammars.tracked["digits"].num_accepted == 1
    SpecplugV2HeadSpeculator._grammar_masks(speculator, _batch(False))
    assert speculator.root_masks.num_masked_rows == 0
    assert bool(speculator.root_masks.allowed.all())
    assert torch.equal(tree().token_ids, unmasked.token_ids)


def _emit(speculator, tokens: list[int]) -> None:
    """A step's tokens for "digits" on the device: its output grows by them."""
    req_states = speculator.req_states
    end = int(req_states.total_len.gpu[0])
    req_states.all_token_ids.gpu[0, end:end + len(tokens)] = torch.tensor(tokens)
    req_states.total_len.gpu[0] = end + len(tokens)


def test_first_step_masks_take_the_choices_tokens_and_the_next_rows_check_them(
        tiny_model_dir):
    """With the choices, the first step's masks advance "digits" by the
    tokens its tree emitted, as decided on the host, with no read of the
    outputs (a wait for the GPU); the copy queued beside them confirms them
    at the next step's rows, again with no read. Where the host's tokens
    differ from the output, those rows' grammar follows the output."""
    from vllm_specplug.integration.grammar_choices import GrammarChoices

    structured = _structured(tiny_model_dir)
    speculator = _speculator(structured)
    SpecplugV2HeadSpeculator._attach_root_masks(speculator)
    SpecplugV2HeadSpeculator._grammar_masks(speculator, _batch())  # reads the output, "1"
    speculator.grammar_choices = GrammarChoices()
    reads = []
    outputs = structured._outputs
    structured._outputs = lambda *args: reads.append(args) or outputs(*args)
    tracked = structured.grammars.tracked["digits"]
    digits = sorted(_allowed_after_one(structured) - {ONE})
    for host, device in (([ONE, ONE], [ONE, ONE]), ([ONE], [digits[0]])):
        structured.begin_step()
        _emit(speculator, device)
        speculator.grammar_choices.emitted = {"digits": host}  # as `correct` decided them
        SpecplugV2HeadSpeculator._grammar_masks(speculator, _batch())
        assert not reads and speculator.guard.num_failures == 0
        assert tracked.unconfirmed == host and speculator.root_masks.num_masked_rows == 2
        found = structured.verifying_grammars(["digits"], _batch(), speculator.req_states)
        assert not reads and structured.num_device_reads == 0
        assert tracked.unconfirmed is None and tracked.num_accepted == int(
            speculator.req_states.total_len.gpu[0]) - PROMPT_LEN
        assert found["digits"].num_processed_tokens == tracked.num_accepted
    assert structured.grammars.num_known_repairs == 1
    assert structured.grammars.num_known_advances == 2


def test_first_step_masks_hold_a_chains_first_draft_to_the_grammar(tiny_model_dir):
    """A chain (topk 1) under first-step masks: its first draft is allowed."""
    structured = _structured(tiny_model_dir)
    speculator = _speculator(structured)
    SpecplugV2HeadSpeculator._attach_root_masks(speculator)
    SpecplugV2HeadSpeculator._grammar_masks(speculator, _batch())
    chain = speculator.runtime.draft_slots(torch.tensor([0, 1]), torch.tensor([ONE, ONE]),
                                           torch.tensor([PROMPT_LEN] * 2), 16, 1, 5, 6)
    assert int(chain.token_ids[0, 1]) in _allowed_after_one(structured)


def test_a_padded_pass_drafts_the_last_structured_requests_tree_again(tiny_model_dir):
    """A pass padded to a capture size repeats its last request (`padded`,
    kernels/tree_rows.py): under first-step masks the padded rows take that
    request's row too and draft its tree again, so every tree written for
    its slot is the same one (the fused step stores them all, the slot
    repeated: `TreeSlots.store`; padded rows that allowed every token drafted
    another tree there). Batch "free", "free", "digits" (pool slots 1, 1, 0),
    padded to 4 rows."""
    structured = _structured(tiny_model_dir)
    speculator = _speculator(structured)
    speculator.max_num_reqs = 4
    SpecplugV2HeadSpeculator._attach_root_masks(speculator)

    def draft(slots: list[int]):
        return speculator.runtime.draft_slots(torch.tensor(slots), torch.tensor([ONE] * len(slots)),
                                              torch.tensor([PROMPT_LEN] * len(slots)), 16, *TREE)

    unmasked = draft([0])  # no rows loaded yet: every token allowed
    allowed = _allowed_after_one(structured)
    assert _children(unmasked, 0) - allowed, "unmasked children are digits already: no test"
    rows = structured.root_bitmask(_batch(), speculator.req_states)  # "digits", "free"
    speculator.root_masks.load(rows[[1, 1, 0]])
    tree = draft([1, 1, 0, 0])
    assert _children(tree, 2) <= allowed
    for field in ("token_ids", "parent_ids", "depths", "packed_mask"):
        assert torch.equal(getattr(tree, field)[3], getattr(tree, field)[2]), field
    assert speculator.root_masks.num_masked_rows == 4


def test_the_fused_steps_padding_stores_its_trees_in_the_spare_slot(tiny_model_dir):
    """`_emit` (the fused decode step's store): rows past the step's requests
    repeat the last one's slot, and whatever they drafted goes to the spare
    slot past the requests', so the last request's slot keeps its own tree
    even where a padded row drafted another (here: another root token).
    Batch: slots 1, 0, 0 (three requests), padded to 4 rows."""
    from vllm_specplug.integration.v2.step_inputs import StepInputs
    from vllm_specplug.integration.v2.tree_slots import TreeSlots

    speculator = _speculator(_structured(tiny_model_dir))
    speculator.tree_slots = TreeSlots(speculator.max_num_reqs + 1, TREE[2], "cpu")
    speculator.step_inputs = StepInputs(4, 2, torch.device("cpu"))
    speculator.drafts = torch.zeros(4, TREE[2] - 1, dtype=torch.int64)
    slots = torch.tensor([1, 0, 0, 0])
    tree = speculator.runtime.draft_slots(slots, torch.tensor([ONE, ONE, ONE, ONE + 1]),
                                          torch.tensor([PROMPT_LEN] * 4), 16, *TREE)
    assert not torch.equal(tree.parent_ids[3], tree.parent_ids[2]) or not torch.equal(
        tree.token_ids[3], tree.token_ids[2]), "the padded row drafted the same tree: no test"
    speculator.step_inputs.num_requests.fill_(3)
    SpecplugV2HeadSpeculator._emit(speculator, slots, tree)
    stored = speculator.tree_slots
    assert torch.equal(stored.parents[0], tree.parent_ids[2])
    assert torch.equal(stored.depths[0], tree.depths[2].to(torch.int32))
    assert torch.equal(stored.bits[0], tree.packed_mask[2])
    assert torch.equal(stored.parents[2], tree.parent_ids[3])  # the spare slot
    assert torch.equal(speculator.drafts[2], tree.token_ids[2, 1:])


def test_root_masks_repeat_the_last_row_in_a_padded_batchs_rows():
    """`RootMasks.load`: rows past the batch up to its padded size
    (`padded_batch`) copy the last request's row; past that, rows another
    step masked are reset."""
    from vllm_specplug.integration.v2.root_masks import RootMasks

    masks = RootMasks(num_rows=8, vocab_size=64, draft_to_target=torch.tensor([0, 3, 33, 40]))
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[2] = 0
    bitmask[2, 1] = 1 << 1          # the last row: target 33 only (draft id 2)
    masks.load(bitmask)
    assert masks.num_masked_rows == 4
    assert masks.allowed[3].tolist() == masks.allowed[2].tolist() == [False, False, True, False]
    assert bool(masks.allowed[:2].all()) and bool(masks.allowed[4:].all())
    masks.load(bitmask[[2, 2, 2, 2, 2]])  # five rows: padded to 8
    assert masks.num_masked_rows == 8
    assert masks.allowed[7].tolist() == [False, False, True, False]
    masks.load(bitmask[:1])
    assert masks.num_masked_rows == 1 and bool(masks.allowed.all())


def test_root_masks_keep_a_row_that_allows_no_draft_id_and_reset_rows_left_over():
    """`RootMasks` on its own: a row allowing only tokens outside the head's
    draft vocabulary keeps its logits (all -inf would make the log-softmax
    NaN); a free row is all-allowed; a smaller batch after a bigger one
    resets the rows past it (a padded pass reads them)."""
    from vllm_specplug.integration.v2.root_masks import RootMasks

    draft_to_target = torch.tensor([0, 3, 33, 40])  # 4 draft ids -> target ids
    masks = RootMasks(num_rows=4, vocab_size=64, draft_to_target=draft_to_target)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3          # row 0: target 3 only (draft id 1)
    bitmask[1, 0] = 1 << 5          # row 1: target 5 only, not a draft id: kept whole
    bitmask[2] = -1                 # row 2: free
    masks.load(bitmask)
    logits = torch.arange(16, dtype=torch.float32).view(4, 4)
    out = masks(logits)
    inf = float("-inf")
    assert out[0].tolist() == [inf, 1.0, inf, inf]
    assert out[1].tolist() == logits[1].tolist()
    assert out[2].tolist() == logits[2].tolist() and out[3].tolist() == logits[3].tolist()
    masks.load(bitmask[:1])
    assert masks.num_masked_rows == 1 and bool(masks.allowed[1:].all())
    assert not bool(masks.allowed[0].all())
    masks.clear()
    assert masks.num_masked_rows == 0 and bool(masks.allowed.all())


def test_grammar_parents_hand_over_each_trees_parents_once():
    """`GrammarParents` (the trees' parents beside vLLM's drafts): what
    `record` took is what `take` gives, once; off CUDA copied at once."""
    from vllm_specplug.integration.v2.grammar_parents import GrammarParents

    kept = GrammarParents(torch.device("cpu"))
    assert kept.take() == {}
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    kept.record(["a", "b"], parents)
    parents.fill_(7)  # the drafting pass's buffer, reused by the next step
    assert kept.take() == {"a": [-1, 0, 0, 1], "b": [-1, 0, 1, 2]}
    assert kept.take() == {}
