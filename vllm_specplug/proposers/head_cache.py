"""The drafter's KV cache for every request in one pool of tensors.

Each request owns a slot: row `slot` of the pool holds its K/V at index =
position (rope already applied), a validity bit per position, and the
drafter's output and logits at its last ingested position. One pool, rather
than a tensor per request, is what lets drafting run as a CUDA graph
(`head_graphs.py`): the graph reads fixed addresses and selects its requests
with a slot index tensor. Ingest writes rows in place (no per-request
concatenation). Keys and values keep the KV heads only; attention groups the
query heads (GQA).

Shapes: S slots, kvh KV heads, C positions of capacity, hd head size, H the
drafter's hidden size, Vd its vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplug.verification.backend import to_device

NO_POSITION = -1  # `last_positions` of a slot holding nothing
MIN_CAPACITY = 256  # positions first allocated per slot; doubles as needed
MIN_SLOTS = 8


@dataclass
class CacheView:
    """One request's cache, copied out (tests, introspection)."""
    keys: torch.Tensor  # [L, kvh, hd] the valid positions, ascending
    values: torch.Tensor  # [L, kvh, hd]
    positions: np.ndarray  # [L] int64
    last_out: torch.Tensor  # [H]
    last_logits: torch.Tensor  # [Vd]


def _grown(size: int, needed: int) -> int:
    while size < needed:
        size *= 2
    return size


class HeadCachePool:
    def __init__(self, num_kv_heads: int, head_dim: int, hidden_size: int, vocab_size: int,
                 dtype: torch.dtype, device: torch.device, num_slots: int = MIN_SLOTS):
        self.shape = (num_kv_heads, head_dim, hidden_size, vocab_size)
        self.dtype, self.device = dtype, device
        self.slot_of: dict[str, int] = {}
        self.version = 0  # bumped when the tensors are reallocated (graphs hold addresses)
        self._allocate(max(num_slots, 1), MIN_CAPACITY)

    def _allocate(self, num_slots: int, capacity: int) -> None:
        kvh, hd, hidden, vocab = self.shape
        old = getattr(self, "keys", None)
        zeros = lambda *s, dtype=self.dtype: torch.zeros(*s, dtype=dtype,  # noqa: E731
                                                          device=self.device)
        tensors = {"keys": zeros(num_slots, kvh, capacity, hd),  # [S, kvh, C, hd]
                   "values": zeros(num_slots, kvh, capacity, hd),  # [S, kvh, C, hd]
                   "valid": zeros(num_slots, capacity, dtype=torch.bool),  # [S, C]
                   "last_out": zeros(num_slots, hidden),  # [S, H]
                   "last_logits": zeros(num_slots, vocab)}  # [S, Vd]
        if old is not None:
            s, c = old.shape[0], old.shape[2]
            for name, tensor in tensors.items():
                source = getattr(self, name)
                if tensor.dim() == 4:
                    tensor[:s, :, :c] = source
                elif name == "valid":
                    tensor[:s, :c] = source
                else:
                    tensor[:s] = source
            self.version += 1
        for name, tensor in tensors.items():
            setattr(self, name, tensor)
        last = getattr(self, "last_positions", np.zeros(0, dtype=np.int64))
        self.last_positions = np.full(num_slots, NO_POSITION, dtype=np.int64)
        self.last_positions[:len(last)] = last  # host copy: no device sync to read it
        taken = set(self.slot_of.values())
        self.free = [s for s in range(num_slots - 1, -1, -1) if s not in taken]

    @property
    def num_slots(self) -> int:
        return self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def bytes_per_slot_position(self) -> int:
        """Memory one position of one slot takes (K and V of every KV head, valid bit)."""
        kvh, hd, _, _ = self.shape
        return 2 * kvh * hd * self.keys.element_size() + 1

    def preallocate(self, num_slots: int, num_positions: int, budget_bytes: int) -> int:
        """Room for `num_slots` requests of `num_positions` positions now, as
        far as `budget_bytes` of keys and values go (never less than held).
        Growing later reallocates: the old and new pools coexist for a
        moment, and every graph that read the old one is captured again. A
        pool made before the engine measures its memory is counted as the
        model's. Returns the capacity."""
        per_position = num_slots * self.bytes_per_slot_position
        fits = budget_bytes // per_position if per_position else num_positions
        capacity = max(self.capacity, min(num_positions, fits))
        if num_slots > self.num_slots or capacity > self.capacity:
            self._allocate(max(num_slots, self.num_slots), capacity)
        return self.capacity

    def reserve(self, num_slots: int, num_positions: int) -> None:
        """Room for `num_slots` requests of `num_positions` positions (doubling)."""
        if num_slots > self.num_slots or num_positions > self.capacity:
            self._allocate(_grown(self.num_slots, num_slots),
                           _grown(self.capacity, num_positions))

    def assign(self, req_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Slots of `req_ids` [R] int64, and which of them are new [R] bool."""
        new = np.array([r not in self.slot_of for r in req_ids], dtype=bool)
        self.reserve(len(self.slot_of) + int(new.sum()), 1)
        for req_id in np.asarray(req_ids, dtype=object)[new]:
            self.slot_of[req_id] = self.free.pop()
        return np.array([self.slot_of[r] for r in req_ids], dtype=np.int64), new

    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.last_positions[slot] = NO_POSITION
            self.free.append(slot)

    def last_position(self, req_id: str) -> int:
        slot = self.slot_of.get(req_id)
        return NO_POSITION if slot is None else int(self.last_positions[slot])

    def adopt(self, req_id: str, keys: torch.Tensor, values: torch.Tensor,
              valid: torch.Tensor) -> None:
        """`req_id` (new) starts with rows at positions 0..L-1 (keys, values
        [kvh, L, hd], valid [L]): its prefix-cache hit, from `HeadBlockStore`."""
        (slot,), _ = self.assign([req_id])
        self.adopt_slot(slot, keys, values, valid)

    def adopt_slot(self, slot: int, keys: torch.Tensor, values: torch.Tensor,
                   valid: torch.Tensor) -> None:
        """`adopt` by slot (device copies only: no sync)."""
        self.adopt_slots([slot], keys, values, valid, [keys.shape[1]])

    def adopt_slots(self, slots: list[int], keys: torch.Tensor, values: torch.Tensor,
                    valid: torch.Tensor, lengths: list[int]) -> None:
        """Several slots start with rows at positions 0..L-1 each, one slot's
        after the other's (keys, values [kvh, sum L, hd], valid [sum L]):
        a few launches whatever their number (a batch of 64 prefix-cache
        hits had cost 8 launches each, `HeadBlockStore.gather_many`). Device
        copies only: no sync."""
        self.reserve(0, max(lengths))
        host_slots = np.asarray(slots, dtype=np.int64)
        row_slots = to_device(np.repeat(host_slots, lengths), self.device)
        positions = to_device(np.concatenate([np.arange(n) for n in lengths]), self.device)
        self.valid.index_fill_(0, to_device(host_slots, self.device), False)
        self.keys[row_slots, :, positions] = keys.transpose(0, 1).to(self.dtype)
        self.values[row_slots, :, positions] = values.transpose(0, 1).to(self.dtype)
        self.valid[row_slots, positions] = valid
        self.last_positions[slots] = np.asarray(lengths) - 1

    def copy_prefix(self, src: int, dst: int, length: int,
                    keep_last: torch.Tensor | None = None) -> None:
        """Slot `dst` takes slot `src`'s rows at positions 0..length-1
        (keys, values, validity), the last one valid only where `keep_last`
        ([1] bool on the device: the two requests have the same token after
        it, which that row was computed with) holds; None: left out. Device
        copies only: no sync."""
        self.keys[dst, :, :length] = self.keys[src, :, :length]
        self.values[dst, :, :length] = self.values[src, :, :length]
        self.valid[dst, :length] = self.valid[src, :length]
        if keep_last is None:
            self.valid[dst, length - 1] = False
        else:
            self.valid[dst, length - 1:length] &= keep_last

    def store(self, slots: np.ndarray, cuts: np.ndarray, row_slots: np.ndarray,
              row_positions: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Drop each slot's positions at or after `cuts[r]` ([R] host), then
        write rows ([T] host slot and position each; keys/values [T, kvh, hd])."""
        self.reserve(0, int(row_positions.max()) + 1)
        on_device = [to_device(a, self.device)
                     for a in (slots, cuts, row_slots, row_positions)]
        self.write(*on_device, keys, values)
        self.note_rows(slots, row_slots, row_positions)

    def write(self, slots: torch.Tensor, cuts: torch.Tensor, row_slots: torch.Tensor,
              row_positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`store`'s device half (device tensors only, no sync: a CUDA graph
        can capture it). A slot listed twice must get identical rows."""
        kept = torch.arange(self.capacity, device=self.device)[None, :] < cuts[:, None]
        self.valid[slots] &= kept
        self.keys[row_slots, :, row_positions] = keys.to(self.dtype)
        self.values[row_slots, :, row_positions] = values.to(self.dtype)
        # a tensor, not `= True`: a Python scalar goes through a CPU tensor, and
        # a CPU-to-GPU copy cannot be captured in a CUDA graph
        self.valid.index_put_((row_slots, row_positions), torch.ones_like(row_positions,
                                                                           dtype=torch.bool))

    def note_rows(self, slots: np.ndarray, row_slots: np.ndarray,
                  row_positions: np.ndarray) -> None:
        """`store`'s host half: every cut is at or below the slot's new rows,
        so its last position is theirs."""
        self.last_positions[slots] = NO_POSITION
        np.maximum.at(self.last_positions, row_slots, row_positions)

    def set_last(self, index: torch.Tensor, out: torch.Tensor, logits: torch.Tensor) -> None:
        """The drafter's output and logits at each slot's last position (index [R] on device)."""
        self.last_out[index] = out.to(self.dtype)
        self.last_logits[index] = logits.to(self.dtype)

    def view(self, req_id: str) -> CacheView:
        slot = self.slot_of[req_id]
        positions = torch.nonzero(self.valid[slot]).flatten()
        keys, values = (t[slot].index_select(1, positions).transpose(0, 1)
                        for t in (self.keys, self.values))
        return CacheView(keys, values, positions.cpu().numpy().astype(np.int64),
                         self.last_out[slot].clone(), self.last_logits[slot].clone())


class HeadBlockStore:
    """The drafter's K/V rows of the target's full KV-cache blocks, by
    physical block id. vLLM's eagle3 keeps its draft KV in the target's paged
    blocks, so a prefix-cache hit hands its drafter the cached prefix's KV
    too; our per-request pool does not, and a request whose prompt starts
    with cached blocks (a repeated prompt, a chat's next turn, a resumed
    preempted request) would draft from its uncached suffix alone. Rows are
    saved once a request's cache covers a whole block and dropped when a step
    writes into a block (vLLM reuses an evicted block's id); a request new to
    the drafter whose first position follows cached blocks gets them back
    (`HeadCachePool.adopt`). A block's last row was computed with the token
    that followed it in the request that filled it (saved beside it,
    `next_ids`); where that row ends the handed-over prefix it is kept only
    when the new request has the same token there (`gather`). At most one
    row per KV-cache slot: one attention layer's KV cache, what vLLM
    allocates for its own draft layer."""

    def __init__(self) -> None:
        self.blocks: dict[int, _SavedBlock] = {}  # by block id

    def gather(self, block_ids, next_id: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Keys, values [kvh, len(block_ids) * block size, hd] and validity
        [len(block_ids) * block size] of these blocks in order; None unless
        every one is stored. The last row was computed with the token that
        followed the prefix in the request that saved it: it stays valid
        only where that token is `next_id`, the new request's own token
        there (kept regardless, it made a repeated seeded request draft,
        and so sample, differently; left out always, a chat's next turn or a
        repeated prompt drafted without the row nearest its suffix: τ 3.31
        on repeats of the built-in model's prompts, 3.43 the first time)."""
        if not self.has_all(block_ids):
            return None
        next_ids = None if next_id is None else torch.tensor([int(next_id)])
        return self.gather_many([block_ids], next_ids)[:3]

    def has_all(self, block_ids) -> bool:
        """Whether every one of `block_ids` (at least one) is stored."""
        return len(block_ids) > 0 and all(int(b) in self.blocks for b in block_ids)

    def gather_many(self, block_lists, next_ids: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """`gather` for several prefixes at once (each stored: `has_all`),
        one after the other: keys, values [kvh, N, hd], validity [N] and each
        prefix's length; `next_ids` [P] int64 (any device): each new
        request's token after its prefix (None: every prefix's last row
        invalid). A few launches, no sync."""
        per_prefix = [[self.blocks[int(b)] for b in block_ids] for block_ids in block_lists]
        parts = [span.rows(start, end)
                 for span, start, end in _runs(block for blocks in per_prefix for block in blocks)]
        keys, values, valid = (torch.cat([part[i] for part in parts], -2 if i < 2 else 0)
                               for i in range(3))
        lengths = [sum(block.span.size for block in blocks) for blocks in per_prefix]
        last = to_device(np.cumsum(lengths) - 1, valid.device)
        if next_ids is None:
            valid.index_fill_(0, last, False)
        else:  # the row stays where the token after it is the new request's too
            saved = _next_ids([blocks[-1] for blocks in per_prefix], valid.device)
            valid[last] &= saved == next_ids.to(valid.device)
        return keys, values, valid, lengths

    def drop(self, block_ids: np.ndarray) -> None:
        for block_id in block_ids:
            self.blocks.pop(int(block_id), None)

    def save_blocks(self, block_ids, keys: torch.Tensor, values: torch.Tensor,
                    valid: torch.Tensor | None = None,
                    next_ids: torch.Tensor | None = None) -> None:
        """Consecutive blocks' rows (keys, values [kvh, n * size, hd] for n
        block ids; valid [n * size]: which rows the drafter holds, all when
        None; next_ids [n] int64: the token each block's last row was
        computed with, None when unknown). One copy of the span, each block
        an index into it: 3-4 copies per call, not per block (a span's
        memory is freed once all its blocks are dropped)."""
        if len(block_ids) == 0:
            return
        if valid is None:
            valid = torch.ones(keys.shape[1], dtype=torch.bool, device=keys.device)
        saved = _SavedSpan(keys.clone(), values.clone(), valid.clone(),
                           keys.shape[1] // len(block_ids),
                           None if next_ids is None else next_ids.to(torch.int64).clone())
        for b, block_id in enumerate(block_ids):
            self.blocks[int(block_id)] = _SavedBlock(saved, b)


class _SavedSpan:
    """The rows of consecutive saved blocks: keys, values [kvh, n * size,
    hd], validity [n * size], `size` rows a block, and the token each
    block's last row was computed with ([n] int64, or None)."""
    __slots__ = ("keys", "values", "valid", "size", "next_ids")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                 size: int, next_ids: torch.Tensor | None = None) -> None:
        self.keys, self.values, self.valid, self.size = keys, values, valid, size
        self.next_ids = next_ids

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [kvh, end - start, hd] and validity [end - start] of rows
        start..end-1 (views)."""
        return self.keys[:, start:end], self.values[:, start:end], self.valid[start:end]


class _SavedBlock:
    """One saved block: block `index` of a `_SavedSpan`. Its views are made
    when read (a hit is rarer than a save: three views a block had cost a
    finishing request about 0.1 ms of host time per dozen blocks)."""
    __slots__ = ("span", "index")

    def __init__(self, span: _SavedSpan, index: int) -> None:
        self.span, self.index = span, index

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [kvh, size, hd] and validity [size] (views)."""
        size = self.span.size
        return self.span.rows(self.index * size, (self.index + 1) * size)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows()[i]

    def __iter__(self):
        return iter(self.rows())


def _runs(blocks) -> list[list]:
    """[span, first row, end row] of each run of blocks that lie one after
    the other in one span, in order: a prefix saved by one request is one
    slice, not a slice a block (64 prefix hits of 12 blocks had cost 2304
    views and a 768-way concatenation of host work in one step)."""
    runs: list[list] = []
    for block in blocks:
        start = block.index * block.span.size
        if runs and runs[-1][0] is block.span and runs[-1][2] == start:
            runs[-1][2] += block.span.size
        else:
            runs.append([block.span, start, start + block.span.size])
    return runs


def _next_ids(blocks: list, device) -> torch.Tensor:
    """[P] int64: the token each block's last row was computed with, -1
    where none was saved (never equal to a token); a few launches, however
    many blocks (each span's tokens concatenated once, then one gather)."""
    found = np.array([b.span.next_ids is not None and b.index < len(b.span.next_ids)
                      for b in blocks])  # a request at the model's length saves one less
    spans = list({id(b.span): b.span for b, ok in zip(blocks, found) if ok}.values())
    if not spans:
        return torch.full((len(blocks),), -1, dtype=torch.int64, device=device)
    offsets = dict(zip((id(span) for span in spans),
                       np.cumsum([0] + [len(span.next_ids) for span in spans[:-1]])))
    index = np.array([offsets[id(b.span)] + b.index if ok else 0
                      for b, ok in zip(blocks, found)], dtype=np.int64)
    ids = torch.cat([span.next_ids.to(device) for span in spans])[to_device(index, device)]
    return ids if found.all() else ids.masked_fill_(~to_device(found, device), -1)
