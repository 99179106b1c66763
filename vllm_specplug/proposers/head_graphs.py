"""The head's passes as captured CUDA graphs: drafting, and a decode step's ingest.

A drafting pass (`HeadRuntime._draft_pass`: num_steps expansions of the
drafter, top-k, pooling, the tree build kernel) launches a few hundred small
kernels; eager, their launch cost is most of a step at small batches. Its
shapes are fixed by (batch, keys read, tree shape) and it never syncs with
the host, so each such key is captured once, lazily, and replayed (vLLM
captures its own eagle drafting the same way). Batches are padded up to
capture sizes (1, 2, 4, then multiples of 8) by repeating the last request.
The keys read are the pool's whole capacity where the attention is the
Triton kernel (it stops at its rows' positions, read on the device: one
graph for every sequence length), else rounded up to a power of two
(`PassGraphs.key_range`). The graphs share one memory pool
and are replayed one at a time; their outputs are read before the next.
If a capture fails the runtime logs why and runs that kind of pass eagerly
from then on (the other kind keeps its graphs).

A decode step's ingest (every request cached before, its accepted tokens
plus one, at most MAX_GRAPHED_ROWS positions each) is the same kind of
pass: padded to [capture size, power-of-two rows] by repetition
(`IngestLayout`), it replays a graph too. Prefills and new requests, whose
sizes vary widely, ingest eagerly. On Model Runner V2 a step where every
request decodes runs ingest and drafting as one pass (`run_step_pass`), one
replay that reads its inputs where the speculator wrote them: host work per
step is then a few launches (the drafting pass alone was 13 to 17 at batch 1
to 64, and 22 with the ingest, docs/results/v2_chain_speed_h200).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from vllm_specplug.verification.backend import next_power_of_2, to_device
from vllm_specplug.verification.metadata import DraftTree

logger = logging.getLogger("vllm_specplug.head_graphs")

BATCH_STEP = 8  # capture sizes above 4 requests: multiples of this
MIN_KEYS = 64  # smallest keys-read bucket
# the least recently replayed graphs are dropped past this: start-up
# captures every padded batch size (35 up to 256 requests) for each draft
# length a step may run (6 for a 16-node tree with `"adaptive": true`: 210),
# and service adds transitions
MAX_GRAPHS = 512
MAX_GRAPHED_ROWS = 16  # positions per request up to which an ingest replays a graph
# captures in service (after start-up's) logged one by one; past these, one
# line in SERVICE_LOG_EVERY
SERVICE_LOG_FIRST = 4
SERVICE_LOG_EVERY = 16


STEP_KIND = "step"  # PassGraphs' kind of a whole decode step (run_step_pass)


def padded_batch(num_requests: int) -> int:
    if num_requests <= 4:
        return next_power_of_2(num_requests)
    return -(-num_requests // BATCH_STEP) * BATCH_STEP


def keys_bucket(num_keys: int, capacity: int) -> int:
    return min(capacity, max(MIN_KEYS, next_power_of_2(num_keys)))


def key_range(graphs: "PassGraphs | None", num_keys: int, capacity: int) -> int:
    """The key range a pass reading `num_keys` runs at: the graphs' own
    (`PassGraphs.key_range`), or a power of two when it runs without graphs."""
    return (graphs.key_range(num_keys, capacity) if graphs is not None
            else keys_bucket(num_keys, capacity))


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: list[torch.Tensor]  # static inputs, copied into before each replay
    outputs: Any  # what the pass returned while captured (static outputs)


def padded(values: torch.Tensor, size: int) -> torch.Tensor:
    """[B, ...] -> [size, ...], the last entry repeated (`values` itself
    when no padding is needed: a graph's inputs are copied in anyway)."""
    if values.shape[0] == size:
        return values
    return torch.cat([values, values[-1:].expand(size - values.shape[0], *values.shape[1:])])


class PassGraphs:
    """The head's passes (drafting, decode ingest) captured per key, lazily,
    in one memory pool; replayed one at a time.

    Args:
        positions_bound_keys: the passes' attention reads no key past its
            query rows' positions, which it reads on the device (the Triton
            kernel, `kernels/head_attention.py`). The key range is then only
            an upper bound, and one graph at the pool's capacity serves every
            range: a power-of-two bucket would capture every (batch, shape)
            again each time the longest request crosses 64, 128, 256, ...
            positions (200-450 ms a capture on the H100, where a step takes
            2-30 ms; docs/results/batch_draft_length_h100_run2).
    """

    def __init__(self, positions_bound_keys: bool = False) -> None:
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.version = None  # the cache pool's tensors the graphs read
        self.memory_pool = None
        self.disabled: set[str] = set()  # kinds whose capture failed: they run eagerly
        self.positions_bound_keys = positions_bound_keys
        # set by the V2 head speculator at the first step of service (after
        # start-up's captures and vLLM's kernel warm-up): a capture after
        # that stalls a step
        self.in_service = False
        self.capturing = False  # in a capture's warm-up or capture (draft_compile.py)
        self.num_service_captures = 0
        self.service_capture_seconds = 0.0

    def key_range(self, num_keys: int, capacity: int) -> int:
        """The key range a pass reading `num_keys` runs (and is keyed) at."""
        return capacity if self.positions_bound_keys else keys_bucket(num_keys, capacity)

    def service_captures(self) -> dict:
        """Captures since start-up's (each stalled a step in service): how
        many, their seconds, and the graphs held now."""
        return {"num_captures": self.num_service_captures,
                "capture_seconds": self.service_capture_seconds, "num_graphs": len(self.graphs)}

    def keys(self, kind: str) -> list[tuple]:
        return [k for k in self.graphs if k[0] == kind]

    def holds(self, version: int, key: tuple) -> bool:
        """Whether `run(version, key, ...)` would replay without capturing
        (a capture runs its pass twice: once to warm up, once replayed)."""
        return version == self.version and key in self.graphs

    def run(self, version: int, key: tuple, run_pass: Callable[..., Any],
            inputs: list[torch.Tensor], *constants, own_inputs: bool = False
            ) -> tuple[bool, Any]:
        """(True, outputs) of `run_pass(*inputs, *constants)` replayed from the
        graph captured for `key` (captured first if new); (False, None) when
        graphs are off or the capture failed: the caller runs it eagerly.
        The shapes of `run_pass` must be fixed by `key`; outputs are the
        graph's own tensors, valid until the next replay. `own_inputs`: the
        inputs are the caller's persistent buffers, the same per key; the
        graph reads them in place (no copy; one is copied in only if its
        address changed)."""
        if key[0] in self.disabled:
            return False, None
        if version != self.version:  # reallocated: the captured addresses are stale
            # A fresh memory pool too: capturing into the pool of the graphs just
            # freed hit an allocator assert on an H100 (docs/results/tree_cuda_h100_graphs).
            self.graphs.clear()
            self.memory_pool = None
            self.version = version
        captured = self.graphs.get(key)
        if captured is not None:
            self.graphs.move_to_end(key)  # the least recently replayed go first
        else:
            captured = self._capture(key, run_pass, inputs, constants, own_inputs)
            if captured is None:
                return False, None
        for static, value in zip(captured.inputs, inputs):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        captured.graph.replay()
        return True, captured.outputs

    def _capture(self, key, run_pass, inputs, constants, own_inputs) -> _Captured | None:
        started = time.perf_counter()
        captured = self._capture_graph(key, run_pass, inputs, constants, own_inputs)
        if captured is None:
            return None
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        self.graphs[key] = captured
        if self.in_service:
            self._service_capture(key, time.perf_counter() - started)
        return captured

    def _service_capture(self, key: tuple, seconds: float) -> None:
        """A capture in service: a step stalled on it (as vLLM warns of a
        Triton kernel compiled during inference)."""
        self.num_service_captures += 1
        self.service_capture_seconds += seconds
        n = self.num_service_captures
        if n <= SERVICE_LOG_FIRST or n % SERVICE_LOG_EVERY == 0:
            logger.warning("vllm-specplug: captured the head's %s pass %s in service (%.0f ms; "
                           "%d such captures, %.1f s in all): start-up capture does not cover "
                           "this shape", key[0], key[1:], 1e3 * seconds, n,
                           self.service_capture_seconds)

    def _capture_graph(self, key, run_pass, inputs, constants, own_inputs) -> _Captured | None:
        self.capturing = True
        try:
            return self._warm_up_and_capture(key, run_pass, inputs, constants, own_inputs)
        finally:
            self.capturing = False

    def _warm_up_and_capture(self, key, run_pass, inputs, constants, own_inputs
                             ) -> _Captured | None:
        static = list(inputs) if own_inputs else [t.clone() for t in inputs]
        try:
            if self.memory_pool is None:
                self.memory_pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compiles kernels, sets up cuBLAS: not capturable
                run_pass(*static, *constants)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of vLLM's other threads do not void the capture
            with torch.cuda.graph(graph, pool=self.memory_pool,
                                  capture_error_mode="thread_local"):
                outputs = run_pass(*static, *constants)
        except Exception as error:  # noqa: BLE001 - the head goes on, eagerly
            logger.warning("vllm-specplug: capturing the head's %s pass as a CUDA graph "
                           "failed (%s: %s); running that pass eagerly from now on", key[0],
                           type(error).__name__, error)
            # only this kind runs eagerly; the others are captured again, in a
            # fresh memory pool (the failed capture's allocations are not trusted)
            self.disabled.add(key[0])
            self.graphs.clear()
            self.memory_pool = None
            return None
        logger.debug("vllm-specplug: captured the head's pass %s", key)
        return _Captured(graph, static, outputs)


def run_draft_pass(graphs: PassGraphs, draft_pass: Callable[..., DraftTree], pool,
                   slots: torch.Tensor, root_token_ids: torch.Tensor,
                   root_positions: torch.Tensor, num_keys: int,
                   shape: tuple[int, int, int]) -> DraftTree:
    """A drafting pass for pool `slots` ([B] on the device), the batch padded
    to a capture size by repeating its last request, replayed from its graph
    (eager if none could be captured)."""
    num_keys = graphs.key_range(num_keys, pool.capacity)
    batch, size = slots.shape[0], padded_batch(slots.shape[0])
    inputs = [padded(t, size) for t in (slots, root_token_ids, root_positions)]
    ok, tree = graphs.run(pool.version, ("draft", size, num_keys, shape), draft_pass, inputs,
                          num_keys, *shape)
    if not ok:
        return draft_pass(slots, root_token_ids, root_positions, num_keys, *shape)
    fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(DraftTree)}
    return DraftTree(**{name: None if value is None else value[:batch]
                        for name, value in fields.items()})


@dataclass
class IngestLayout:
    """A decode step's ingest padded to fixed shapes: Bp requests x R rows.
    Rows past a request's count repeat its last row and padding requests
    repeat the last request, so every extra write equals a real one."""
    slots: np.ndarray  # [Bp] int64
    take: np.ndarray  # [Bp * R] int64, the input row each padded row copies
    positions: np.ndarray  # [Bp, R] int64
    cuts: np.ndarray  # [Bp] int64, each request's first new position (later ones are dropped)
    request_slots: np.ndarray  # [B] int64, unpadded (host bookkeeping)
    row_slots: np.ndarray  # [T] int64
    row_positions: np.ndarray  # [T] int64


def decode_ingest_layout(pool, req_ids: list[str], positions: np.ndarray,
                         counts: list[int]) -> IngestLayout | None:
    """The padded layout of an ingest (positions [T] host, `counts` per
    request), or None unless every request is cached already and brings at
    most MAX_GRAPHED_ROWS positions (prefills and new requests run eagerly)."""
    if max(counts) > MAX_GRAPHED_ROWS or any(r not in pool.slot_of for r in req_ids):
        return None
    slots = np.array([pool.slot_of[r] for r in req_ids], dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    rows, size = next_power_of_2(int(counts.max())), padded_batch(len(req_ids))
    take = starts[:, None] + np.minimum(np.arange(rows)[None, :], counts[:, None] - 1)
    take = np.concatenate([take, np.repeat(take[-1:], size - len(req_ids), axis=0)])
    pad = lambda a: np.concatenate([a, np.repeat(a[-1:], size - len(a))])  # noqa: E731
    return IngestLayout(pad(slots), take.reshape(-1), positions[take], pad(positions[starts]),
                        slots, np.repeat(slots, counts), positions)


def run_ingest_pass(graphs: PassGraphs, ingest_pass: Callable[..., None], pool,
                    layout: IngestLayout, target_hidden: torch.Tensor,
                    next_token_ids: torch.Tensor) -> None:
    """`ingest_pass` (HeadRuntime._ingest_pass) on `layout`, replayed from its
    graph (eager if none could be captured); the host bookkeeping after."""
    needed = int(layout.positions.max()) + 1
    pool.reserve(0, needed)  # before the key: a reallocation voids the graphs
    num_keys = graphs.key_range(needed, pool.capacity)
    take = to_device(layout.take, target_hidden.device)
    device_array = lambda a: to_device(a, pool.device)  # noqa: E731
    inputs = [device_array(layout.slots), target_hidden[take],
              next_token_ids[take.to(next_token_ids.device)],
              device_array(layout.positions), device_array(layout.cuts)]
    key = ("ingest", *layout.positions.shape, num_keys)
    ok, _ = graphs.run(pool.version, key, ingest_pass, inputs, num_keys)
    if not ok:
        ingest_pass(*inputs, num_keys)
    pool.note_rows(layout.request_slots, layout.row_slots, layout.row_positions)


def run_step_pass(graphs: PassGraphs | None, step_pass: Callable[..., None], pool,
                  inputs: list[torch.Tensor], num_keys: int, shape: tuple[int, int, int],
                  emit: Callable) -> None:
    """A whole decode step (`HeadRuntime._step_pass`: ingest, then draft) on
    `inputs`, the caller's persistent buffers already padded to a capture
    size: replayed from its graph, reading them in place (eager if none)."""
    pool.reserve(0, num_keys)  # before the key: a reallocation voids the graphs
    num_keys = key_range(graphs, num_keys, pool.capacity)
    # inputs[3]: positions [Bp, R]; inputs[1]: the target's rows (a graph
    # captured at start-up on another width or dtype is not replayed on them)
    key = (STEP_KIND, *inputs[3].shape, num_keys, shape, inputs[1].shape[-1], inputs[1].dtype)
    ran = graphs is not None and graphs.run(pool.version, key, step_pass, inputs, num_keys,
                                            shape, emit, own_inputs=True)[0]
    if not ran:
        step_pass(*inputs, num_keys, shape, emit)
