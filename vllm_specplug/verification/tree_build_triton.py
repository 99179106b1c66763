"""Launch glue of `kernels/tree_build.py` (inputs already checked)."""
from __future__ import annotations

import torch

from vllm_specplug.kernels.tree_build import build_draft_tree_kernel
from vllm_specplug.verification.backend import next_power_of_2
from vllm_specplug.verification.metadata import MASK_WORD_BITS, DraftCandidates, DraftTree

BLOCK_J = 32


def build_draft_tree_triton(candidates: DraftCandidates, root_token_ids: torch.Tensor,
                            seq_lens: torch.Tensor, num_draft_tokens: int) -> DraftTree:
    batch, num_cands = candidates.token_ids.shape
    n = num_draft_tokens
    num_words = -(-n // MASK_WORD_BITS)
    device = root_token_ids.device

    def nodes(dtype=torch.int64, *shape):
        return torch.empty(batch, n, *shape, dtype=dtype, device=device)

    tree = DraftTree(token_ids=nodes(), parent_ids=nodes(), cand_ids=nodes(),
                     depths=nodes(), positions=nodes(),
                     attn_mask=nodes(torch.bool, n),
                     packed_mask=nodes(torch.int32, num_words),
                     first_child_ids=nodes(), next_sibling_ids=nodes())
    node_of_cand = torch.empty(batch, num_cands, dtype=torch.int64, device=device)
    build_draft_tree_kernel[(batch,)](
        candidates.token_ids.contiguous(), candidates.scores.contiguous(),
        candidates.parent_ids.contiguous(), root_token_ids.contiguous(),
        seq_lens.contiguous(), node_of_cand, tree.token_ids, tree.parent_ids,
        tree.cand_ids, tree.depths, tree.positions, tree.attn_mask.view(torch.int8),
        tree.packed_mask, tree.first_child_ids, tree.next_sibling_ids,
        num_cands, n, C_PAD=next_power_of_2(num_cands), N_PAD=next_power_of_2(n),
        BLOCK_J=BLOCK_J, NUM_WORDS=num_words)
    return tree
