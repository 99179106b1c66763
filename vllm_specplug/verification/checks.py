"""Input checks run by the public wrappers before any kernel launches.

Kernels trust their inputs (an out-of-range index is a silent wild read on a
GPU), so every error a caller can make is caught here and named.
"""
from __future__ import annotations

import torch


class VerificationInputError(ValueError):
    """A tensor given to a tree/verification function is malformed."""


def check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    """`shape` entries of None match any size."""
    ok = tensor.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(tensor.shape, shape))
    if not ok:
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise VerificationInputError(
            f"{name} has shape {list(tensor.shape)}, expected {wanted}")


def check_dtype(name: str, tensor: torch.Tensor, dtypes: tuple) -> None:
    if tensor.dtype not in dtypes:
        raise VerificationInputError(
            f"{name} has dtype {tensor.dtype}, expected one of {list(dtypes)}")


def check_range(name: str, tensor: torch.Tensor, low: int, high: int) -> None:
    """All values in [low, high)."""
    if tensor.numel() and (tensor.min() < low or tensor.max() >= high):
        bad = tensor[(tensor < low) | (tensor >= high)][0].item()
        raise VerificationInputError(
            f"{name} holds {bad}, outside the valid range [{low}, {high})")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise VerificationInputError(f"tensors on different devices: {devices}")


def check_parents_earlier(name: str, parent_ids: torch.Tensor, root_value: int,
                          first_index: int = 0) -> None:
    """Every parent index is `root_value` or smaller than its own index."""
    index = torch.arange(first_index, first_index + parent_ids.shape[-1],
                         device=parent_ids.device)
    bad = (parent_ids != root_value) & ((parent_ids >= index) | (parent_ids < 0))
    if bad.any():
        b, i = bad.nonzero()[0].tolist()
        raise VerificationInputError(
            f"{name}[{b}, {i}] = {parent_ids[b, i].item()}: a parent must come "
            f"earlier than its child (or be {root_value} for the root)")


def check_siblings_distinct(token_ids: torch.Tensor, parent_ids: torch.Tensor) -> None:
    """Two children of one node with the same token make the residual wrong."""
    same_parent = parent_ids[:, :, None] == parent_ids[:, None, :]
    same_token = token_ids[:, :, None] == token_ids[:, None, :]
    upper = torch.triu(torch.ones_like(same_parent), diagonal=1)
    clash = same_parent & same_token & upper
    if clash.any():
        b, i, j = clash.nonzero()[0].tolist()
        raise VerificationInputError(
            f"tree nodes {i} and {j} of request {b} are siblings with the same "
            f"token {token_ids[b, i].item()}; siblings must be distinct")
