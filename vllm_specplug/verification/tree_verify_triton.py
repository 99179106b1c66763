"""Launch glue of `kernels/tree_verify.py` (inputs already checked)."""
from __future__ import annotations

import torch

from vllm_specplug.kernels.tree_verify import verify_tree_greedy_kernel
from vllm_specplug.verification.backend import next_power_of_2
from vllm_specplug.verification.metadata import DraftTree, VerifyOutput
from vllm_specplug.verification.metadata import empty_verify_output


def verify_tree_greedy_triton(tree: DraftTree, target_argmax: torch.Tensor) -> VerifyOutput:
    batch, num_nodes = tree.token_ids.shape
    out = empty_verify_output(batch, num_nodes, target_argmax.device)
    verify_tree_greedy_kernel[(batch,)](
        tree.token_ids.contiguous(), tree.parent_ids.contiguous(),
        target_argmax.contiguous(), out.output_token_ids, out.num_accepted,
        out.accepted_node_ids, num_nodes, N_PAD=next_power_of_2(num_nodes))
    return out
