"""`specplug_ngram` on the device: launch glue of `kernels/ngram_match.py`.

Under Model Runner V2 the histories already live on the GPU
(`req_states.all_token_ids`), so drafting there costs two small kernel
launches and no host synchronisation, where the host proposer needs a
device-to-host copy every step (the GPU idles meanwhile). Same selection as
the host proposer (`ngram.longest_matches`, the reference the tests compare
against), same drafts.
"""
from __future__ import annotations

import torch

from vllm_specplug.proposers.base import DeviceDrafter, DeviceProposeBatch
from vllm_specplug.verification.backend import next_power_of_2

# Positions one scan program covers; long histories get more programs.
BLOCK = 256


class NgramDeviceDrafter(DeviceDrafter):
    trusted = True  # drafts are copies of the history: always in the vocabulary
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, max_num_reqs: int,
                 max_model_len: int, device: torch.device) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.num_blocks = -(-max_model_len // BLOCK)
        # [max_num_reqs, num_blocks] int64: each block's best packed score
        self.block_scores = torch.zeros(max_num_reqs, self.num_blocks, dtype=torch.int64,
                                        device=device)

    def propose(self, batch: DeviceProposeBatch, draft_ids: torch.Tensor,
                num_draft: torch.Tensor) -> None:
        from vllm_specplug.kernels.ngram_match import ngram_finalize_kernel, ngram_scan_kernel

        num_reqs, k = draft_ids.shape
        if num_reqs == 0:
            return
        scores = self.block_scores[:num_reqs]
        ngram_scan_kernel[(num_reqs, self.num_blocks)](
            batch.token_ids, batch.token_ids.stride(0), batch.idx_mapping, batch.num_tokens,
            batch.num_sampled, scores, self.num_blocks,
            K=k, N_MIN=self.n_min, N_MAX=self.n_max, BLOCK=BLOCK, num_warps=4)
        counts = batch.draft_counts
        ngram_finalize_kernel[(num_reqs,)](
            batch.token_ids, batch.token_ids.stride(0), batch.idx_mapping, batch.num_tokens,
            batch.num_sampled, scores, draft_ids, num_draft,
            num_draft if counts is None else counts, self.num_blocks,
            K=k, K_PAD=next_power_of_2(k), BLOCKS_PAD=next_power_of_2(self.num_blocks),
            COUNT=counts is not None, num_warps=1)
