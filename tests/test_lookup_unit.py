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
from vllm_specplug.proposers.lookup import DeviceLookup, lookup_chains
from vllm_specplug.proposers.ngram import longest_matches


def reference(history: np.ndarray, n_min: int, n_max: int, k: int):
    """One row through the n-gram proposer's own selection: the draft if it
    has k tokens, else None."""
    n, end = longest_matches(history[None, :], np.array([len(history)]), n_min, n_max, k)
    draft = history[end[0] + 1:end[0] + 1 + k]
    return draft.tolist() if n[0] > 0 and len(draft) == k else None


def padded(histories: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, histories)) + 3
    token_ids = np.full((len(histories), width), -5, dtype=np.int64)  # junk past each end
    for row, history in enumerate(histories):
        token_ids[row, :len(history)] = history
    return token_ids, np.array([len(h) for h in histories])


def test_a_digit_loop_drafts_its_continuation():
    """The SmolLM2 request that made a batch-64 wave: `"id": "1234567890123...`."""
    digits = np.array([7, 8] + [33, 34, 35, 36, 37, 38, 39, 40, 41, 32] * 2 + [33, 34])
    drafts, found = lookup_chains(*padded([digits]), 3, 5, 5)
    assert found.tolist() == [True]
    assert drafts[0].tolist() == [35, 36, 37, 38, 39]


@pytest.mark.parametrize("n_min,n_max,k", [(3, 5, 5), (1, 3, 3), (2, 2, 7)])
def test_rows_take_the_ngram_selection_where_it_has_k_tokens(n_min, n_max, k):
    rng = np.random.default_rng(n_min * 10 + k)
    histories = [rng.integers(0, 4, size=n) for n in (1, 2, 5, 9, 30, 31, 80)]
    histories.append(np.array([1, 2, 3, 4, 1, 2, 3]))  # a match with too few tokens after it
    drafts, found = lookup_chains(*padded(histories), n_min, n_max, k)
    want = [reference(h, n_min, n_max, k) for h in histories]
    assert found.tolist() == [w is not None for w in want]
    assert 0 < found.sum() < len(histories)  # both kinds of row are covered
    for row, draft in enumerate(want):
        if draft is not None:
            assert drafts[row].tolist() == draft


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
    assert int(lookup.num_found) == 1


def test_options_name_the_field_and_the_fix():
    Eagle3TreeOptions(model="h", prompt_lookup_min=3).validate("specplug_eagle3")
    Eagle3TreeOptions(model="h", topk=4).validate("specplug_eagle3")  # off: trees are fine
    cases = [({"topk": 4, "prompt_lookup_min": 3}, "set topk=1"),
             ({"prompt_lookup_min": -1}, "must be 0 (off) or an integer >= 1"),
             ({"prompt_lookup_min": 2.5}, "prompt_lookup_min=2.5 must be 0 (off)"),
             ({"prompt_lookup_min": 2, "prompt_lookup_max": "5"}, "prompt_lookup_max=5 must be"),
             ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_max=3 must be")]
    for fields, message in cases:
        with pytest.raises(ProposerConfigError, match=re.escape(message)):
            Eagle3TreeOptions(model="h", **fields).validate("specplug_eagle3")
