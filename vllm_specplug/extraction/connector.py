"""KV connector that saves the target's hidden states, on CPU and CUDA alike.

Used with vLLM's `extract_hidden_states` speculative method, which stores the
hidden states of the layers in `eagle_aux_hidden_state_layer_ids` into the KV
cache of one cache-only attention layer. When a request finishes this connector
keeps its blocks, gathers its rows on the worker and writes
`{hidden_states: [T, L, H], token_ids: [T]}` atomically (temporary name, fsync,
rename), so a reader sees a whole file or none.

Differences from vLLM's `ExampleHiddenStatesConnector`: no pinned memory or CUDA
streams on the CPU path; prompt *and* response by default; per-request paths
must stay inside `shared_storage_path`; layer ids recorded in the file.

    kv_transfer_config={"kv_connector": "SpecplugHiddenStatesConnector",
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": DIR}}

Per request (`SamplingParams(extra_args={"kv_transfer_params": {...}})`):
`hidden_states_path` (relative to DIR), `include_output_tokens` (default from
the extra config key of the same name, itself default True),
`save_hidden_states` (False: nothing written, e.g. a generation-only pass). The finished
request's `kv_transfer_params` carry `hidden_states_path` and `num_tokens`, or
`hidden_states_error`. A save that fails on the worker leaves
`<hidden_states_path>.error` with the reason instead of the file.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA)

from vllm_specplug.extraction.gather import gather_rows
from vllm_specplug.extraction.registrar import CONNECTOR_NAME
from vllm_specplug.extraction.storage import (StoragePathError, resolve_inside,
                                              save_safetensors_atomic)

logger = logging.getLogger("vllm_specplug.extraction")

ERROR_SUFFIX = ".error"
# Keys of a saved per-request file.
HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"


@dataclass
class PendingSave:
    req_id: str
    path: str
    token_ids: torch.Tensor  # [T] int64
    block_ids: list[int]


@dataclass
class HiddenStatesConnectorMetadata(KVConnectorMetadata):
    pending_saves: list[PendingSave] = field(default_factory=list)


def hidden_state_layer_ids(vllm_config) -> list[int]:
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "extract_hidden_states":
        raise ValueError(
            f"{CONNECTOR_NAME} needs speculative_config method "
            "'extract_hidden_states' with draft_model_config.hf_config."
            "eagle_aux_hidden_state_layer_ids")
    return list(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids)


def check_layer_ids(layer_ids: list[int], num_hidden_layers: int) -> None:
    """Layer id l is the residual stream entering decoder layer l (0: the
    embeddings, `num_hidden_layers`: after the last layer, before the norm)."""
    bad = [i for i in layer_ids if not 0 <= int(i) <= num_hidden_layers]
    if bad or not layer_ids:
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {layer_ids}: ids must be in "
            f"[0, {num_hidden_layers}] for a model with {num_hidden_layers} layers "
            f"(out of range: {bad})")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {layer_ids} repeat a layer")


class SpecplugHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("shared_storage_path"):
            raise ValueError(
                f"{CONNECTOR_NAME}: set kv_connector_extra_config."
                "shared_storage_path to the directory the files go to")
        self.storage_dir = os.path.abspath(extra["shared_storage_path"])
        self.include_output_tokens = bool(extra.get("include_output_tokens", True))
        self.layer_ids = hidden_state_layer_ids(vllm_config)
        check_layer_ids(self.layer_ids,
                        vllm_config.model_config.get_total_num_hidden_layers())
        self.group_id = _hidden_state_group(kv_cache_config)
        self.block_size = _group_block_size(vllm_config, kv_cache_config,
                                            self.group_id)
        self.file_metadata = {
            "layer_ids": json.dumps(self.layer_ids),
            "model": str(vllm_config.model_config.model),
        }
        # scheduler side
        self._paths: dict[str, str] = {}
        self._path_errors: dict[str, str] = {}
        self._pending: list[PendingSave] = []
        # worker side
        self._kv_cache: torch.Tensor | None = None
        self._written: set[str] = set()
        self._tp_rank: int | None = None

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        for new_req in scheduler_output.scheduled_new_reqs:
            self._assign_path(new_req.req_id, _request_params(new_req.sampling_params))
        meta = HiddenStatesConnectorMetadata(pending_saves=self._pending)
        self._pending = []
        return meta

    def _assign_path(self, req_id: str, params: dict) -> None:
        relative = params.get("hidden_states_path") or f"{_file_stem(req_id)}.safetensors"
        try:
            self._paths[req_id] = str(resolve_inside(self.storage_dir, relative))
        except StoragePathError as error:
            logger.error("request %s: %s", req_id, error)
            self._path_errors[req_id] = str(error)

    def request_finished(self, request, block_ids: list[int]):
        req_id = request.request_id
        error = self._path_errors.pop(req_id, None)
        path = self._paths.pop(req_id, None)
        if error is not None:
            return False, {"hidden_states_error": error}
        params = request.kv_transfer_params or {}
        if path is None or params.get("save_hidden_states") is False:
            return False, None  # aborted before scheduling, or asked not to save
        token_ids = self._captured_token_ids(request, params)
        self._pending.append(PendingSave(req_id, path, token_ids, list(block_ids)))
        return True, {"hidden_states_path": path, "num_tokens": int(token_ids.numel())}

    def _captured_token_ids(self, request, params: dict) -> torch.Tensor:
        if params.get("include_output_tokens", self.include_output_tokens):
            # The last sampled token was never fed to the model: no hidden state.
            ids = list(request.all_token_ids)[:-1]
        else:
            ids = list(request.prompt_token_ids or [])
        # An aborted request may not have computed all of them (chunked prefill):
        # rows past num_computed_tokens were never written.
        return torch.tensor(ids[:request.num_computed_tokens], dtype=torch.int64)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self.group_id < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group_id])

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import (
            CacheOnlyAttentionLayer)

        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer,
                                             list(kv_caches))
        if len(layers) != 1:
            raise RuntimeError(f"{CONNECTOR_NAME}: expected one cache-only layer, "
                               f"found {sorted(layers)}")
        self._kv_cache = kv_caches[next(iter(layers))]
        if self._kv_cache.shape[2] != self.block_size:
            raise RuntimeError(f"{CONNECTOR_NAME}: cache block size "
                               f"{self._kv_cache.shape[2]} != {self.block_size}")

    def start_load_kv(self, *args, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for pending in getattr(meta, "pending_saves", ()):
                self._save(pending)
        done, self._written = self._written, set()
        return (done or None), None

    def _save(self, pending: PendingSave) -> None:
        if not self._writes_files():  # another rank writes it; the blocks go back here too
            self._written.add(pending.req_id)
            return
        try:
            hidden = gather_rows(self._kv_cache, pending.block_ids, self.block_size,
                                 pending.token_ids.numel())
            save_safetensors_atomic(
                {HIDDEN_STATES_KEY: hidden.to("cpu"), TOKEN_IDS_KEY: pending.token_ids},
                pending.path, metadata=self.file_metadata)
        except Exception as error:  # noqa: BLE001 - one bad file must not stop serving
            logger.exception("saving hidden states of %s to %s failed",
                             pending.req_id, pending.path)
            # The client already holds the path: leave the reason beside it.
            _write_error_marker(pending.path, f"{type(error).__name__}: {error}")
        # Reported either way: the blocks must be released.
        self._written.add(pending.req_id)

    def _writes_files(self) -> bool:
        """Only the first tensor-parallel rank writes: every rank holds the
        whole hidden states, and a second rank's write of the same file,
        landing after the reader took and removed it, left a stale file in
        staging (TP=2 on CPU)."""
        if self._tp_rank is None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = get_tensor_model_parallel_rank()
        return self._tp_rank == 0

    def get_finished_count(self) -> int:
        return 1

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return "LBNHC"


def error_marker_path(path: str) -> str:
    """Where a failed save leaves its reason instead of the file."""
    return f"{path}{ERROR_SUFFIX}"


def _write_error_marker(path: str, message: str) -> None:
    try:
        with open(error_marker_path(path), "w") as handle:
            handle.write(message)
    except OSError:
        logger.exception("could not write the error marker of %s", path)


def _request_params(sampling_params) -> dict:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get("kv_transfer_params") or {}


def _file_stem(req_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in req_id)


def _hidden_state_group(kv_cache_config) -> int:
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec,
                                                        HiddenStateCacheSpec)]
    if not ids and len(groups) == 1:
        return 0                # one group for all layers (hybrid manager off)
    if len(ids) != 1:
        raise ValueError(f"{CONNECTOR_NAME}: expected one hidden-state KV cache "
                         f"group, found {len(ids)} among {len(groups)}")
    return ids[0]


def _group_block_size(vllm_config, kv_cache_config, group_id: int) -> int:
    if kv_cache_config is None:
        return vllm_config.cache_config.block_size
    return kv_cache_config.kv_cache_groups[group_id].kv_cache_spec.block_size
