"""The requests' token histories in GPU memory where our speculator scans them.

Model Runner V2 keeps every request's tokens in `req_states.all_token_ids`
([max_num_reqs, max_model_len] int32, a `StagedWriteTensor`). To save GPU
memory it places that buffer in pinned host memory read through UVA, except
for vLLM's own n-gram methods (`use_dense_all_token_ids` in
`v1/worker/gpu/model_runner.py`), whose kernels scan every history each step:
read through UVA, each scan crosses PCIe. Our n-gram drafter's kernels
(`specplug_ngram` drafting on the device) and our heads' prompt lookups
(proposers/lookup.py) scan the same way, so they get the same dense buffer.

The swap happens in the patched `init_speculator`
(patches/gpu_v2_model_runner.py): `RequestState` was made just before and
holds no request yet, and the runner and its kernels read
`req_states.all_token_ids` afresh at every use. Option `token_history`:
"auto" (the default: on the device where our speculator scans it there),
"device", or "host" (vLLM's placement kept: to measure what the dense buffer
buys, or to spare its GPU memory at a large max_num_seqs x max_model_len).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger("vllm_specplug.token_history")

DEVICE, HOST = "device", "host"


def history_place(req_states) -> str:
    """"host" where the histories are read through UVA, else "device"."""
    return HOST if getattr(req_states.all_token_ids, "_uva_buf", None) is not None else DEVICE


def wanted_place(token_history: str, scans_on_device: bool) -> str | None:
    """The place the option asks for; None: leave vLLM's choice ("auto"
    where our speculator does not scan the histories on the device)."""
    if token_history == "auto":
        return DEVICE if scans_on_device else None
    return token_history


def place_token_histories(req_states, device: torch.device, token_history: str,
                          scans_on_device: bool, make_buffer: Callable) -> str:
    """Move `req_states.all_token_ids` to device memory where wanted, before
    any request is written to it. Returns where the histories are after.
    `make_buffer(shape, dtype, device)` builds the dense buffer (vLLM's
    `StagedWriteTensor` without UVA, made by the runner's patch, the one
    place that imports it; a stand-in in CPU tests, where pinned memory
    cannot be allocated)."""
    wanted, placed = wanted_place(token_history, scans_on_device), history_place(req_states)
    if wanted is None or wanted == placed:
        return placed
    if wanted == HOST:  # vLLM made it dense for a reason of its own: keep it
        logger.info("vllm-specplug: token_history 'host' left the histories in GPU memory, "
                    "where vLLM placed them")
        return placed
    if req_states.req_id_to_index:
        raise RuntimeError("vllm-specplug: the token histories can only be moved before "
                           "any request is added")
    shape = (req_states.max_num_reqs, req_states.max_model_len)
    req_states.all_token_ids = make_buffer(shape, torch.int32, device)
    logger.info("vllm-specplug: the requests' token histories in GPU memory (%.1f MiB, "
                "%d x %d): our drafter scans them each step (token_history)",
                shape[0] * shape[1] * 4 / 2**20, *shape)
    return history_place(req_states)

