"""Launch glue of `kernels/rejection.py` (inputs already checked)."""
from __future__ import annotations

import torch

from vllm_specplug.kernels.rejection import (rejection_sample_chain_kernel,
                                             residual_argmax_reduce_kernel,
                                             verify_tree_stochastic_kernel)
from vllm_specplug.verification.backend import next_power_of_2
from vllm_specplug.verification.metadata import DraftTree, VerifyOutput
from vllm_specplug.verification.metadata import empty_verify_output

BLOCK_V = 2048
NUM_WARPS = 8
MIN_SLICE = 4096  # never split the vocabulary finer than this


def choose_splits(batch: int, vocab_size: int, device: torch.device,
                  num_splits: int | None) -> int:
    """Enough programs to fill the GPU, vocabulary slices of >= MIN_SLICE."""
    if num_splits is None:
        programs = 4 * (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)
        num_splits = max(1, min(-(-programs // batch), -(-vocab_size // MIN_SLICE)))
        # Rounded down to a power of two: in the H100 sweep
        # (benchmarks/sweep_stochastic.py) 8 splits beat 9 by ~20% at batch 64,
        # and 2 beat 3 at batch 256.
        num_splits = 1 << (num_splits.bit_length() - 1)
    return num_splits


def _reduce(out: VerifyOutput, part_val, part_idx, num_splits: int) -> VerifyOutput:
    batch, row_len = out.output_token_ids.shape
    residual_argmax_reduce_kernel[(batch,)](
        part_val, part_idx, out.num_accepted, out.output_token_ids, row_len,
        NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits))
    return out


def _partials(batch: int, num_splits: int, device):
    return (torch.empty(batch, num_splits, dtype=torch.float32, device=device),
            torch.empty(batch, num_splits, dtype=torch.int32, device=device))


def verify_tree_stochastic_triton(tree: DraftTree, target_probs, uniform_samples,
                                  exp_samples, num_splits) -> VerifyOutput:
    batch, num_nodes, vocab_size = target_probs.shape
    num_splits = choose_splits(batch, vocab_size, target_probs.device, num_splits)
    out = empty_verify_output(batch, num_nodes, target_probs.device)
    part_val, part_idx = _partials(batch, num_splits, target_probs.device)
    verify_tree_stochastic_kernel[(batch, num_splits)](
        tree.token_ids.contiguous(), tree.parent_ids.contiguous(),
        target_probs.contiguous(), uniform_samples.contiguous(),
        exp_samples.contiguous(), out.output_token_ids, out.num_accepted,
        out.accepted_node_ids, part_val, part_idx, num_nodes, vocab_size,
        N_PAD=next_power_of_2(num_nodes), NUM_SPLITS=num_splits, BLOCK_V=BLOCK_V,
        num_warps=NUM_WARPS)
    return _reduce(out, part_val, part_idx, num_splits)


def rejection_sample_chain_triton(draft_token_ids, num_draft_tokens, draft_probs,
                                  target_probs, uniform_samples, exp_samples,
                                  num_splits) -> VerifyOutput:
    batch, max_drafts = draft_token_ids.shape
    vocab_size = target_probs.shape[2]
    num_splits = choose_splits(batch, vocab_size, target_probs.device, num_splits)
    out = empty_verify_output(batch, max_drafts + 1, target_probs.device)
    part_val, part_idx = _partials(batch, num_splits, target_probs.device)
    rejection_sample_chain_kernel[(batch, num_splits)](
        draft_token_ids.contiguous(), num_draft_tokens.contiguous(),
        draft_probs.contiguous(), target_probs.contiguous(),
        uniform_samples.contiguous(), exp_samples.contiguous(),
        out.output_token_ids, out.num_accepted, out.accepted_node_ids,
        part_val, part_idx, max_drafts, vocab_size,
        NUM_SPLITS=num_splits, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return _reduce(out, part_val, part_idx, num_splits)
