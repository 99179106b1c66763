"""Proposers: one module per method. See `docs/proposers.md` for the interface."""
from vllm_specplug.proposers.base import (ProposeBatch, Proposer, ProposerContext,
                                          ProposerOptions, StopReason)

__all__ = ["ProposeBatch", "Proposer", "ProposerContext", "ProposerOptions", "StopReason"]
