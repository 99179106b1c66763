"""`specplug_mtp`: a target's own MTP layer drafting EAGLE-2 dynamic trees.

Multi-token prediction layers (DeepSeek-V3, MiMo, ...) draft from the
target's last hidden state; vLLM's `mtp` method drafts a chain with them.
Here the layer drafts EAGLE-2 trees through the same runtime and engine
patches as `specplug_eagle3` (`eagle3_head.HeadRuntime` with
`draft_layers.MtpDraftLayer`, `integration/tree_*.py`), with the same
options: `topk`, `num_steps`, `num_draft_tokens`, `draft_temperature`.
The layer is read from the target's checkpoint, in MiMo's layout (what
`vllm-specplug train-mtp` writes; `vllm-specplug build-model tiny-mtp`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_specplug.proposers.base import ProposerConfigError, ProposerOptions
from vllm_specplug.proposers.eagle3 import TreeOptions, TreeProposer, check_tree_attention_fits
from vllm_specplug.draft_models.mtp_checkpoint import MTP_ARCHITECTURE, NUM_MTP_LAYERS_KEY

METHOD = "specplug_mtp"
TREE_MTP_DRAFTER_QUALNAME = "vllm_specplug.integration.v1.tree_drafter.TreeMtpDrafter"


@dataclass(frozen=True)
class MtpTreeOptions(TreeOptions):
    method_name: ClassVar[str] = METHOD


class MtpTreeProposer(TreeProposer):
    """Drafts EAGLE-2 trees with the target's MTP layer (`TreeMtpDrafter`)."""
    options_cls: ClassVar[type[ProposerOptions]] = MtpTreeOptions
    drafter_qualname: ClassVar[str] = TREE_MTP_DRAFTER_QUALNAME

    @classmethod
    def check_target(cls, name: str, options: MtpTreeOptions, target_hf) -> None:
        arch = (getattr(target_hf, "architectures", None) or ["?"])[0]
        layers = int(getattr(target_hf, NUM_MTP_LAYERS_KEY, None) or 0)
        if arch != MTP_ARCHITECTURE or layers < 1:
            raise ProposerConfigError(
                f"speculative_config for method {name!r}: the target ({arch}, "
                f"{NUM_MTP_LAYERS_KEY}={layers}) has no MTP layer in MiMo's layout to "
                "draft with; add one with `vllm-specplug train-mtp --target MODEL --data "
                "DATA --out DIR` and serve DIR (built-in: `vllm-specplug build-model "
                "tiny-mtp`)")
        check_tree_attention_fits(name, options, target_hf)

    @classmethod
    def load_drafter(cls, options: MtpTreeOptions, target_dir: str):
        """MTP layer 0 of the target's checkpoint, with the target's lm_head."""
        from vllm_specplug.draft_models.mtp_checkpoint import read_mtp_tensors
        from vllm_specplug.draft_models.mtp_model import MtpConfig, MtpLayer
        from vllm_specplug.draft_models.target import TargetParts
        from vllm_specplug.proposers.draft_layers import LoadedDrafter

        target = TargetParts.load(target_dir)
        tensors, _ = read_mtp_tensors(target_dir)
        layer = MtpLayer(MtpConfig.from_target(target.config))
        layer.load_checkpoint_tensors(tensors, 0)
        return LoadedDrafter(f"MTP layer 0 of {target_dir}", None, layer,
                             target.lm_head_weight)
