"""Where Model Runner V2 keeps the requests' token histories for our
speculators (integration/v2/token_history.py): the option, and the swap of
`req_states.all_token_ids` before any request. vLLM's `StagedWriteTensor`
needs pinned memory (CUDA), so here a stand-in buffer plays it; the GPU suite
checks the real one (tests/gpu/test_model_runner_v2.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_specplug.integration.v2.token_history import (DEVICE, HOST, history_place,
                                                        place_token_histories)


def _req_states(uva: bool, req_ids: dict | None = None):
    buffer = SimpleNamespace(gpu=torch.zeros(4, 16, dtype=torch.int32),
                             _uva_buf=object() if uva else None)
    return SimpleNamespace(all_token_ids=buffer, max_num_reqs=4, max_model_len=16,
                           req_id_to_index=req_ids or {})


def _dense(shape, dtype, device):
    return SimpleNamespace(gpu=torch.zeros(shape, dtype=dtype, device=device), made=True)


@pytest.mark.parametrize("option, scans, place", [("auto", True, DEVICE), ("auto", False, HOST),
                                                   ("device", False, DEVICE),
                                                   ("host", True, HOST)])
def test_histories_go_to_the_device_where_asked_or_scanned(option, scans, place):
    req_states = _req_states(uva=True)
    uva = req_states.all_token_ids
    assert place_token_histories(req_states, torch.device("cpu"), option, scans,
                                 _dense) == place == history_place(req_states)
    if place == DEVICE:
        assert req_states.all_token_ids.made and req_states.all_token_ids.gpu.shape == (4, 16)
        assert req_states.all_token_ids.gpu.dtype == torch.int32
    else:
        assert req_states.all_token_ids is uva


def test_histories_vllm_keeps_dense_stay_where_they_are():
    req_states = _req_states(uva=False)
    dense = req_states.all_token_ids
    for option in ("auto", "device", "host"):
        assert place_token_histories(req_states, torch.device("cpu"), option, True,
                                     _dense) == DEVICE
        assert req_states.all_token_ids is dense


def test_histories_are_not_moved_once_a_request_was_added():
    req_states = _req_states(uva=True, req_ids={"r0": 0})
    with pytest.raises(RuntimeError, match="before any request is added"):
        place_token_histories(req_states, torch.device("cpu"), "auto", True, _dense)


@pytest.mark.parametrize("extra, place", [({}, "auto"), ({"token_history": "host"}, "host"),
                                          ({"token_history": "device"}, "device")])
def test_token_history_is_a_general_option(extra, place):
    from vllm_specplug.integration.config import translate

    for method in ("specplug_ngram", "specplug_suffix"):
        vllm_args, selection = translate({"method": method, "num_speculative_tokens": 3,
                                          **extra})
        assert "token_history" not in vllm_args and selection.token_history == place


def test_a_bad_token_history_names_the_field_and_the_fix():
    from vllm_specplug.integration.config import translate
    from vllm_specplug.proposers.base import ProposerConfigError

    with pytest.raises(ProposerConfigError,
                       match="token_history='gpu' must be 'device' .* or 'host'"):
        translate({"method": "specplug_ngram", "num_speculative_tokens": 3,
                   "token_history": "gpu"})
