"""Proposers on their own: n-gram against a brute-force definition, suffix's
global cache across requests, hybrid's ordered choice and fan-out."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.proposers.base import ProposeBatch, ProposerContext, StopReason
from vllm_specplug.proposers.hybrid import HybridOptions, HybridProposer
from vllm_specplug.proposers.ngram import NgramOptions, NgramProposer
from vllm_specplug.proposers.suffix import SuffixOptions, SuffixProposer

CONTEXT = ProposerContext(num_speculative_tokens=5, max_model_len=512, vocab_size=16,
                          device="cpu")


def make_batch(histories, k, req_ids=None):
    width = max(len(h) for h in histories) + 3
    buffer = np.full((len(histories), width), 7, dtype=np.int32)  # junk past the end
    for i, history in enumerate(histories):
        buffer[i, :len(history)] = history
    return ProposeBatch(req_ids or [str(i) for i in range(len(histories))], buffer,
                        np.array([len(h) for h in histories]), k)


def brute_force_ngram(history, n_min, n_max, k):
    """Longest n; copy after the most recent occurrence with k tokens after
    it, else after the earliest occurrence."""
    for n in range(n_max, n_min - 1, -1):
        suffix = history[-n:]
        starts = [s for s in range(len(history) - n) if history[s:s + n] == suffix]
        if len(history) <= n or not starts:
            continue
        full = [s for s in starts if s + n + k <= len(history)]
        start = max(full) if full else min(starts)
        return history[start + n:start + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(histories=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40),
                          min_size=1, max_size=6),
       n_min=st.integers(1, 3), extra=st.integers(0, 2), k=st.integers(1, 5))
def test_ngram_matches_brute_force(histories, n_min, extra, k):
    proposer = NgramProposer(NgramOptions(n_min, n_min + extra), CONTEXT)
    drafts = proposer.propose(make_batch(histories, k))
    assert drafts == [brute_force_ngram(h, n_min, n_min + extra, k) for h in histories]


def finished_then_matching(options):
    proposer = SuffixProposer(options, CONTEXT)
    proposer.start_request("a", np.array([1, 2, 3]))
    proposer.update_request("a", [5, 6, 7, 8, 9, 10, 11, 12])
    proposer.stop_request("a", StopReason.FINISHED)
    proposer.start_request("b", np.array([4]))
    proposer.update_request("b", [5, 6, 7])
    return proposer.propose(make_batch([[4, 5, 6, 7]], 4, ["b"]))[0]


def test_suffix_global_cache_helps_a_later_request():
    # Speculation length = max_spec_factor x match length (3 tokens matched).
    assert finished_then_matching(SuffixOptions(min_token_prob=0.0)) == [8, 9, 10]
    assert finished_then_matching(SuffixOptions(min_token_prob=0.0, max_spec_factor=2.0)
                                  ) == [8, 9, 10, 11]  # capped by k = 4
    # Without the global cache the finished response is forgotten.
    assert finished_then_matching(SuffixOptions(min_token_prob=0.0,
                                                max_cached_requests=0)) == []


class Recorder(NgramProposer):
    def __init__(self, drafts, calls):
        super().__init__(NgramOptions(), CONTEXT)
        self.drafts, self.calls = drafts, calls

    def start_request(self, req_id, prompt):
        self.calls.append(("start", req_id))

    def propose(self, batch):
        self.calls.append(("propose", tuple(batch.req_ids)))
        return [self.drafts[r] for r in batch.req_ids]


def test_hybrid_takes_the_first_long_enough_draft_in_order():
    hybrid = HybridProposer(HybridOptions(proposers=[{"method": "specplug_ngram"}],
                                          min_draft_tokens=2), CONTEXT)
    calls: list = []
    first = Recorder({"a": [1, 2, 3], "b": [4], "c": []}, calls)
    second = Recorder({"b": [5, 6], "c": []}, calls)
    hybrid.members = [first, second]
    hybrid.start_request("a", np.array([0]))
    drafts = hybrid.propose(make_batch([[0], [0], [0]], 3, ["a", "b", "c"]))
    assert drafts == [[1, 2, 3], [5, 6], []]
    assert calls == [("start", "a"), ("start", "a"), ("propose", ("a", "b", "c")),
                     ("propose", ("b", "c"))]


def test_builtin_proposers_say_how_sure_they_are_of_each_token():
    """n-gram: the match length over prompt_lookup_max, per token; suffix:
    arctic's path probabilities turned into each token's probability given
    the ones before; hybrid: the chosen member's."""
    from vllm_specplug.proposers.base import Drafts
    from vllm_specplug.proposers.suffix import _conditional

    ngram = NgramProposer(NgramOptions(1, 4), CONTEXT)
    drafts = ngram.propose(make_batch([[1, 2, 3, 9, 1, 2, 3], [5, 6]], 2))
    assert isinstance(drafts, Drafts) and drafts == [[9, 1], []]
    assert drafts.confidences == [[0.75, 0.75], None]  # a 3-gram matched, of at most 4
    assert _conditional([0.75, 0.5, 0.5]) == [0.75, 2 / 3, 1.0]
    assert _conditional([0.0, 0.0]) == [0.0, 0.0]
    suffix = SuffixProposer(SuffixOptions(min_token_prob=0.0, max_spec_factor=4.0), CONTEXT)
    for i, response in enumerate([[5, 6, 7], [5, 6, 7], [5, 6, 8], [5, 9, 1]]):
        suffix.start_request(f"r{i}", np.array([1, 2, 3]))
        suffix.update_request(f"r{i}", response)
        suffix.stop_request(f"r{i}", StopReason.FINISHED)
    suffix.start_request("q", np.array([1, 2, 3, 5]))
    drafts = suffix.propose(make_batch([[1, 2, 3, 5]], 3, ["q"]))
    assert drafts == [[6, 7]] and np.allclose(drafts.confidences[0], [0.75, 2 / 3])
    hybrid = HybridProposer(HybridOptions(proposers=[{"method": "specplug_ngram"}]), CONTEXT)
    hybrid.start_request("a", np.array([1, 2, 3, 9, 1, 2, 3]))
    drafts = hybrid.propose(make_batch([[1, 2, 3, 9, 1, 2, 3]], 2, ["a"]))
    assert drafts == [[9, 1]] and drafts.confidences[0] is not None


def _forbidding(token: int):
    """A stand-in grammar: every token but `token` allowed, anywhere."""
    def allowed(token_ids: list[int]) -> int:
        return next((n for n, t in enumerate(token_ids) if t == token), len(token_ids))
    return allowed


def test_suffix_offers_the_likeliest_path_the_grammar_allows():
    """After [1, 2] the prompt continues with 3 4 (twice), 3 9 and 3 7: the
    chain is 3 4 ...; where the grammar forbids 4, suffix offers 3 then the
    likeliest allowed child of 3 from arctic's speculation tree, not a chain
    the scheduler would cut after 3. Unconstrained rows, and
    `grammar_drafts: false`, keep the chain. Hybrid hands each member its
    rows' checks."""
    prompt = np.array([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3, 4, 6, 1, 2, 3, 7, 1, 2])

    def propose(options, valid_prefix, proposer_cls=SuffixProposer):
        proposer = proposer_cls(options, CONTEXT)
        for req_id in ("free", "json"):
            proposer.start_request(req_id, prompt)
        batch = make_batch([prompt.tolist()] * 2, 3, ["free", "json"])
        batch.valid_prefix.update(valid_prefix)
        return proposer.propose(batch)

    options = SuffixOptions(min_token_prob=0.0, max_spec_factor=4.0, max_cached_requests=0)
    chain = propose(options, {})
    assert chain[0] == chain[1] and chain[0][:2] == [3, 4]
    drafts = propose(options, {1: _forbidding(4)})
    assert drafts[0] == chain[0]
    assert drafts[1][0] == 3 and drafts[1][1] in (9, 7) and 4 not in drafts[1]
    assert len(drafts.confidences[1]) == len(drafts[1])
    off = SuffixOptions(min_token_prob=0.0, max_spec_factor=4.0, max_cached_requests=0,
                        grammar_drafts=False)
    assert propose(off, {1: _forbidding(4)}) == chain
    hybrid = HybridOptions(proposers=[{"method": "specplug_suffix", "min_token_prob": 0.0,
                                       "max_spec_factor": 4.0, "max_cached_requests": 0}])
    assert propose(hybrid, {1: _forbidding(4)}, HybridProposer) == drafts


def test_head_drafts_know_the_grammar_by_default_every_step_on_v1_first_step_on_v2():
    """`grammar_drafts` unset: every drafting step masked on the V1 runner,
    the first one only on Model Runner V2 (its masks ride in the graphed
    pass there, docs/results/v2_grammar_first_smollm2_h200; every step made
    SmolLM2's chain 3x slower under a JSON schema,
    docs/results/v2_grammar_smollm2_h200); set, it holds on both."""
    import pytest

    from vllm_specplug.proposers.base import ProposerConfigError
    from vllm_specplug.proposers.eagle3 import Eagle3TreeOptions
    from vllm_specplug.proposers.mtp import MtpTreeOptions

    default = Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": "head"})
    mtp = MtpTreeOptions.from_dict("specplug_mtp", {})
    for options in (default, mtp):
        assert options.masks_drafts()
        assert not options.masks_first_step_only(model_runner_v2=False)
        assert options.masks_first_step_only(model_runner_v2=True)
    for value in (True, False):
        options = Eagle3TreeOptions.from_dict("specplug_eagle3",
                                              {"model": "head", "grammar_drafts": value})
        assert options.masks_drafts() is value
        for v2 in (True, False):
            assert not options.masks_first_step_only(model_runner_v2=v2)
    first = MtpTreeOptions.from_dict("specplug_mtp", {"grammar_drafts": "first"})
    for v2 in (True, False):
        assert first.masks_drafts() and first.masks_first_step_only(v2)
    with pytest.raises(ProposerConfigError,
                       match="grammar_drafts='yes' must be true, false or 'first'"):
        Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": "head", "grammar_drafts": "yes"})
    with pytest.raises(ProposerConfigError, match="grammar_drafts=1 must be bool or str"):
        Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": "head", "grammar_drafts": 1})


def test_draft_attention_picks_the_heads_attention_path():
    """`draft_attention`: "auto" (our Triton kernel on CUDA), "triton" or
    "torch" (the PyTorch path); anything else is refused naming the field."""
    import pytest

    from vllm_specplug.proposers.base import ProposerConfigError
    from vllm_specplug.proposers.eagle3 import Eagle3TreeOptions
    from vllm_specplug.proposers.mtp import MtpTreeOptions

    assert Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": "h"}).draft_attention == "auto"
    for way in ("auto", "triton", "torch"):
        assert MtpTreeOptions.from_dict("specplug_mtp",
                                        {"draft_attention": way}).draft_attention == way
    with pytest.raises(ProposerConfigError, match="draft_attention='flash' must be one of "
                                                  "auto, triton, torch"):
        Eagle3TreeOptions.from_dict("specplug_eagle3", {"model": "h", "draft_attention": "flash"})
