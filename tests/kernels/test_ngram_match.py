"""The device n-gram drafter (kernels/ngram_match.py) against the host
proposer's selection (`ngram.longest_matches`): token for token, on random
and repetitive histories, several blocks, odd K, rows that must not draft."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specplug.proposers.base import DeviceProposeBatch
from vllm_specplug.proposers.ngram import longest_matches
from vllm_specplug.proposers.ngram_device import BLOCK, NgramDeviceDrafter


def reference(histories: list[np.ndarray], num_sampled: list[int], n_min: int, n_max: int,
              k: int) -> tuple[list[list[int]], list[int]]:
    """Padded drafts and draft lengths, from the host proposer's selection."""
    drafts, lengths = [], []
    for history, sampled in zip(histories, num_sampled):
        length = len(history)
        n, end = longest_matches(history[None, :], np.array([length]), n_min, n_max, k)
        draft = []
        if sampled > 0 and n[0] > 0:
            draft = history[end[0] + 1:end[0] + 1 + k].tolist()
        lengths.append(len(draft))
        drafts.append(draft + [int(history[-1])] * (k - len(draft)))
    return drafts, lengths


def run_device(histories, num_sampled, n_min, n_max, k, max_len, device, seed=0):
    """Histories scattered into shuffled state slots of a [slots, max_len] buffer."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(histories) + 3
    slots = torch.randperm(num_slots, generator=gen)[:len(histories)]
    token_ids = torch.randint(0, 50, (num_slots, max_len), generator=gen, dtype=torch.int32)
    num_tokens = torch.zeros(num_slots, dtype=torch.int32)
    for slot, history in zip(slots.tolist(), histories):
        token_ids[slot, :len(history)] = torch.from_numpy(history)
        num_tokens[slot] = len(history)
    batch = DeviceProposeBatch([f"r{i}" for i in range(len(histories))],
                               token_ids.to(device), slots.to(device), num_tokens.to(device),
                               torch.tensor(num_sampled, dtype=torch.int32, device=device))
    drafter = NgramDeviceDrafter(n_min, n_max, num_slots, max_len, torch.device(device))
    draft_ids = torch.full((len(histories), k), -7, dtype=torch.int64, device=device)
    num_draft = torch.full((len(histories),), -7, dtype=torch.int32, device=device)
    drafter.propose(batch, draft_ids, num_draft)
    return draft_ids.cpu().tolist(), num_draft.cpu().tolist()


@pytest.mark.parametrize("k,n_min,n_max", [(5, 2, 5), (3, 1, 3), (7, 3, 4)])
def test_random_histories_match_the_host_selection(device, k, n_min, n_max):
    rng = np.random.default_rng(k * 10 + n_min)
    max_len = BLOCK + 77                      # two scan blocks
    lengths = [1, 2, 3, n_min + 1, 17, 64, BLOCK - 1, BLOCK + 1, max_len, 150]
    histories = [rng.integers(0, 6, size=n).astype(np.int32) for n in lengths]
    num_sampled = [1, 1, 2, 1, 0, 3, 1, 1, 1, 1]   # row 4 is a prefill chunk
    want = reference(histories, num_sampled, n_min, n_max, k)
    assert run_device(histories, num_sampled, n_min, n_max, k, max_len, device) == \
        (want[0], want[1])


def test_repetitive_text_prefers_a_full_continuation(device):
    """Period 3 < K: the most recent match ends right before the end (2 tokens
    after it); ours copies from an earlier one with all K tokens after it."""
    k = 5
    history = np.array([9, 8] + [1, 2, 3] * 6, dtype=np.int32)
    drafts, lengths = run_device([history], [1], 2, 4, k, 64, device)
    assert lengths == [k] and drafts[0] == [1, 2, 3, 1, 2]
    assert (drafts, lengths) == tuple(reference([history], [1], 2, 4, k))


def test_no_match_pads_with_the_last_token(device):
    history = np.arange(40, dtype=np.int32)          # no repeated token
    drafts, lengths = run_device([history], [1], 1, 3, 4, 64, device)
    assert lengths == [0] and drafts == [[39] * 4]


def test_speculator_device_path_drafts_what_the_host_path_drafts(device):
    """The Model Runner V2 adapter over stand-in request states: the device
    path (kernels, no lifecycle) and the host path (mirror, lifecycle,
    `propose`) give the same padded drafts step after step."""
    from tests.v2_helpers import States, make_speculator, step

    rng = np.random.default_rng(3)
    states = {path: States(device=device) for path in ("host", "device")}
    speculators = {"host": make_speculator(states["host"], device=device),
                   "device": make_speculator(states["device"], use_device_drafter=True,
                                             device=device)}
    prompts = {"a": [1, 2, 3, 4] * 3, "b": rng.integers(0, 4, 20).tolist(), "c": [5, 6]}
    for path in states:
        for slot, (req_id, prompt) in enumerate(prompts.items()):
            states[path].add(req_id, 3 - slot, prompt)
    for _ in range(6):
        accepted = {r: rng.integers(0, 4, rng.integers(1, 4)).tolist() for r in prompts}
        drafts = {}
        for path in states:
            for req_id, tokens in accepted.items():
                states[path].sample(req_id, tokens)
            sampled = [len(accepted[r]) for r in prompts]
            drafts[path] = step(speculators[path], states[path], list(prompts), sampled)[0]
        assert torch.equal(drafts["host"], drafts["device"]), drafts
    stats = speculators["device"].stats.as_dict()
    assert stats["num_steps"] == 6 and stats["num_draft_slots"] == 6 * 3 * 3
    assert 0 < stats["num_draft_tokens"] <= stats["num_draft_slots"]


def test_counts_add_draft_tokens_and_slots(device):
    histories = [np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32),
                 np.arange(10, dtype=np.int32), np.array([4, 4, 4, 4], dtype=np.int32)]
    num_sampled = [1, 1, 0]
    k = 4
    slots = torch.arange(3, device=device)
    token_ids = torch.zeros(3, 16, dtype=torch.int32)
    for i, h in enumerate(histories):
        token_ids[i, :len(h)] = torch.from_numpy(h)
    batch = DeviceProposeBatch(["a", "b", "c"], token_ids.to(device), slots,
                               torch.tensor([8, 10, 4], dtype=torch.int32, device=device),
                               torch.tensor(num_sampled, dtype=torch.int32, device=device),
                               torch.tensor([100, 200], dtype=torch.int64, device=device))
    drafts = torch.zeros(3, k, dtype=torch.int64, device=device)
    num_draft = torch.zeros(3, dtype=torch.int32, device=device)
    NgramDeviceDrafter(2, 3, 3, 16, torch.device(device)).propose(batch, drafts, num_draft)
    want_lengths = reference(histories, num_sampled, 2, 3, k)[1]
    assert num_draft.tolist() == want_lengths == [3, 0, 0]  # n=3 ends at 4: 3 tokens after
    assert batch.draft_counts.tolist() == [100 + 3, 200 + 2 * k]


def test_lookup_merge_on_the_kernels_takes_what_the_host_reference_takes(device):
    """`DeviceLookup.merge` (prompt lookups in place of a head's chains):
    the kernels' rows and drafts equal its host reference's, on histories
    with and without a match of K tokens, a prefill chunk among them."""
    from vllm_specplug.proposers.lookup import DeviceLookup

    rng = np.random.default_rng(3)
    k, max_len = 5, BLOCK + 40
    histories = [rng.integers(0, 5, size=n).astype(np.int32) for n in (4, 9, 60, BLOCK + 30)]
    histories += [np.arange(50, dtype=np.int32), np.array([1, 2, 3] * 5, dtype=np.int32)]
    num_sampled = torch.tensor([1, 1, 1, 2, 1, 0], dtype=torch.int32)
    token_ids = torch.zeros(len(histories) + 2, max_len, dtype=torch.int32)
    num_tokens = torch.zeros(len(histories) + 2, dtype=torch.int32)
    slots = torch.randperm(len(histories) + 2, generator=torch.Generator().manual_seed(1))
    for slot, history in zip(slots.tolist(), histories):
        token_ids[slot, :len(history)] = torch.from_numpy(history)
        num_tokens[slot] = len(history)
    merged = []
    for kernels in (True, False):
        lookup = DeviceLookup(3, 5, len(histories) + 2, max_len, k, torch.device(device),
                              kernels=kernels)
        chains = torch.full((len(histories), k), -1, dtype=torch.int64, device=device)
        on = [t.to(device) for t in (token_ids, slots[:len(histories)], num_tokens, num_sampled)]
        lookup.merge([f"r{i}" for i in range(len(histories))], on[0], on[1], on[2], on[3],
                     chains)
        merged.append((chains.cpu().tolist(), lookup.stats()["lookup_rows"]))
    assert merged[0] == merged[1]
    assert 0 < merged[0][1] < len(histories)  # rows of both kinds
