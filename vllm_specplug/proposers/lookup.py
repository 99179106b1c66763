"""Prompt-lookup drafts in place of a head's chain where the history repeats.

A head drafts what its training text made likely; a request that has fallen
into a loop (a small model's greedy output repeating a sentence, a digit
string, a list's pattern) or copies its prompt is drafted better by looking
the continuation up in its own history (prompt lookup decoding, Saxena
2023; vLLM's `ngram`). On SmolLM2 at batch 64 (H100, MT-Bench, bf16) one
request of 64 decoding a digit string for 124 steps at one token a step made
our chain's whole wave (docs/results/smollm2_request_steps_h100_s73); on CPU
(float32, MT-Bench) lookups with N = 3 took SmolLM2's chain from 1.43 to
1.98 tokens a verify step, every output exact
(docs/results/smollm2_chain_lookup_cpu).

`prompt_lookup_min` > 0 turns it on for chains (`topk` 1): each step, a
request whose last n tokens (prompt_lookup_min <= n <= prompt_lookup_max)
occurred earlier with K tokens after them drafts those K tokens
(`ngram.longest_matches`' choice); the others keep the head's chain. The
head ingests and drafts as before, so its state never depends on which
drafts were verified. Selection only: verification is the target's, so
lossless either way. Steps whose drafts are masked by a grammar keep the
head's (its drafts know the grammar; lookups do not).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.proposers.base import DeviceProposeBatch, require
from vllm_specplug.proposers.ngram import longest_matches


def check_lookup_options(options, name: str) -> None:
    """`prompt_lookup_min` / `prompt_lookup_max` of a tree drafter's options."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    require(whole(options.prompt_lookup_min) and options.prompt_lookup_min >= 0, name,
            f"prompt_lookup_min={options.prompt_lookup_min!r} must be 0 (off) or an "
            "integer >= 1")
    if options.prompt_lookup_min == 0:
        return
    require(whole(options.prompt_lookup_max)
            and options.prompt_lookup_max >= options.prompt_lookup_min, name,
            f"prompt_lookup_max={options.prompt_lookup_max} must be >= "
            f"prompt_lookup_min={options.prompt_lookup_min}")
    require(options.topk == 1, name,
            f"prompt_lookup_min={options.prompt_lookup_min} drafts chains only: set "
            f"topk=1 (it is {options.topk}) or prompt_lookup_min=0")


def lookup_chains(token_ids: np.ndarray, num_tokens: np.ndarray, n_min: int, n_max: int,
                  k: int) -> tuple[np.ndarray, np.ndarray]:
    """Host lookups. `token_ids` [B, W]: each row's history, valid up to
    `num_tokens` [B]. Returns (drafts [B, k] int64, found [B] bool): found
    where an n-gram recurs with k tokens after it."""
    num_tokens = num_tokens.astype(np.int64)
    best_n, best_end = longest_matches(token_ids, num_tokens, n_min, n_max, k)
    found = (best_n > 0) & (best_end + k < num_tokens)
    starts = np.where(found, best_end + 1, 0)
    columns = starts[:, None] + np.arange(k)[None, :]
    drafts = np.take_along_axis(token_ids, np.minimum(columns, token_ids.shape[1] - 1), axis=1)
    return drafts.astype(np.int64), found


class DeviceLookup:
    """Lookups on the device for Model Runner V2 (`NgramDeviceDrafter`'s
    kernels, no host sync), merged into the head's chains in place."""

    def __init__(self, n_min: int, n_max: int, max_num_reqs: int, max_model_len: int,
                 k: int, device: torch.device, kernels: bool | None = None) -> None:
        from vllm_specplug.proposers.ngram_device import NgramDeviceDrafter

        self.k = k
        # the Triton kernels (None: on CUDA); else the host reference, for
        # Model Runner V2's host-side steps driven on CPU (tests)
        self.kernels = device.type == "cuda" if kernels is None else kernels
        self.drafter = NgramDeviceDrafter(n_min, n_max, max_num_reqs, max_model_len, device)
        self.drafts = torch.zeros(max_num_reqs, k, dtype=torch.int64, device=device)  # [S, K]
        self.num_draft = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # [S]
        self.num_found = torch.zeros((), dtype=torch.int64, device=device)  # rows taken, summed

    def merge(self, req_ids: list[str], token_ids: torch.Tensor, idx_mapping: torch.Tensor,
              num_tokens: torch.Tensor, num_sampled: torch.Tensor,
              chains: torch.Tensor) -> None:
        """`chains` [num_reqs, K] int64: the head's drafts, replaced where a
        lookup finds K tokens (`token_ids` [slots, max_len] the histories,
        valid up to `num_tokens` [slots]; `num_sampled` [num_reqs])."""
        num_reqs = chains.shape[0]
        drafts, num_draft = self.drafts[:num_reqs], self.num_draft[:num_reqs]
        slots = idx_mapping[:num_reqs]
        if self.kernels:
            batch = DeviceProposeBatch(req_ids, token_ids, slots, num_tokens,
                                       num_sampled[:num_reqs])
            self.drafter.propose(batch, drafts, num_draft)
            found = num_draft == self.k
        else:
            rows, found = lookup_chains(token_ids[slots].cpu().numpy(),
                                        num_tokens[slots].cpu().numpy(),
                                        self.drafter.n_min, self.drafter.n_max, self.k)
            drafts.copy_(torch.from_numpy(rows))
            found = torch.from_numpy(found).to(chains.device)
        found &= num_sampled[:num_reqs] > 0
        torch.where(found[:, None], drafts, chains, out=chains)
        self.num_found += found.sum()
