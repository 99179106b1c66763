"""Prefix-cache hits for the EAGLE-3/MTP head on Model Runner V2.

vLLM's `eagle3` keeps its draft KV in the target's paged blocks, so a request
whose prompt starts on cached blocks (a chat's next turn, a shared system
prompt, a repeated prompt) finds its drafter's KV there too. Our head keeps
its KV per state slot (`HeadCachePool`); without help such a request drafts
from its uncached suffix alone, and accepts less (SmolLM2 on MT-Bench, H100:
τ 1.51-1.56 vs vLLM's 1.63-1.72 with prefix caching on).

The V1 runner's fix (`HeadBlockStore`, integration/v1/prefix_rows.py) saves
a block's head rows as soon as the head covers it: the host knows every
position there. With V2's async scheduling the host does not know which
draft positions were accepted, so here:

- the block ids of each request are read from the scheduler output (new
  requests' `block_ids`, running requests' `new_block_ids`);
- when a request finishes or is preempted, its slot's rows of the blocks
  the scheduler counted as computed are saved by block id, with their
  validity bits (device copies, no sync; rows the head never ingested stay
  invalid);
- a block handed out fresh (a new owner: vLLM reuses evicted block ids)
  loses its saved rows;
- a new request whose computed prefix is whole blocks, all saved, starts
  with their rows (`HeadCachePool.adopt_slot`); one whose hit has a block
  not saved (still being filled by a request running beside it: a burst on
  one prompt, `n` > 1 samples) takes that request's rows after the step's
  prefill ingest (`fill_missed`), and its hit blocks are never saved from
  its own slot.

The prefix's last row was computed with the token that followed it in the
request that saved it: saved beside it (read from the request's token ids on
the device), the row is kept where the new request's token there is the same
(a repeated prompt, a chat's next turn), left out elsewhere
(`HeadBlockStore.gather_many`). vLLM's `eagle3` keeps it either way.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.proposers.head_cache import HeadBlockStore
from vllm_specplug.verification.backend import to_device


class PrefixBlocks:
    """Saved head rows by KV block, and the block lists they come from."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.store = HeadBlockStore()
        self.block_ids: dict[str, list[int]] = {}  # request -> its blocks (group 0)
        self.hits: dict[str, int] = {}  # new request -> positions its prefix hit supplied
        # request -> its leading blocks the head never ingested (a hit it
        # could not adopt): never saved from its slot, where they are empty
        self.unowned: dict[str, int] = {}
        self.num_adopted = 0  # requests that started on saved rows (tests, stats)
        # requests whose prefix hit found some block unsaved: the head drafts
        # from their uncached suffix alone, where vLLM's eagle3 has the whole
        # prefix's draft KV (bench's `by repeat`: issue 26)
        self.num_missed = 0
        self.missed_positions = 0  # their hits' positions, summed
        # missed request -> (its slot, its hit): filled after the step's
        # prefill ingest from a running request's slot (`fill_missed`)
        self.pending: dict[str, tuple[int, int]] = {}
        self.num_filled = 0  # of the missed, those filled so

    def schedule(self, scheduler_output, slot_of, num_computed, pool,
                 token_ids: torch.Tensor | None = None) -> None:
        """Before the runner applies `scheduler_output`: save the finished and
        preempted requests' blocks (`slot_of(req_id)` -> their state slot,
        still theirs; `num_computed(slot)` -> positions the scheduler counted
        computed; `token_ids` [slots, max_len]: each slot's tokens, V2's
        `all_token_ids`), drop freshly allocated blocks, record new block
        lists."""
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(scheduler_output.preempted_req_ids or ())
        for req_id in gone:
            slot = slot_of(req_id)
            # a hit never offered for adoption was not adopted either
            unowned = self.unowned.pop(req_id, self.hits.pop(req_id, 0) // self.block_size)
            self.pending.pop(req_id, None)
            if slot is not None and pool is not None:
                self._save(self.block_ids.get(req_id, []), slot, num_computed(slot), pool,
                           None if token_ids is None else token_ids[slot], unowned)
            self.block_ids.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            ids = list(new.block_ids[0]) if new.block_ids else []
            cached = new.num_computed_tokens // self.block_size
            self.store.drop(ids[cached:])
            self.block_ids[new.req_id] = ids
            if new.num_computed_tokens and new.num_computed_tokens % self.block_size == 0:
                self.hits[new.req_id] = new.num_computed_tokens
        running = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(running.req_ids, running.new_block_ids):
            if new_ids:
                self.store.drop(new_ids[0])
                self.block_ids.setdefault(req_id, []).extend(new_ids[0])

    def _save(self, block_ids: list[int], slot: int, num_positions: int, pool,
              token_ids: torch.Tensor | None, unowned: int = 0) -> None:
        """The request's whole blocks from its first one not saved yet,
        past its `unowned` first blocks: a block still saved was a
        prefix-cache hit of this request (a block handed out fresh is
        dropped), whose rows it adopted (less a last row left out for
        another next token), or, where the hit was not adopted, never
        ingested: saved again, they would only lose rows; and an unowned
        block (a hit not adopted for want of it) was never ingested either:
        saved, it would hand every later hit empty rows as adopted, and
        the request that filled it would find it saved and keep its own
        rows (a burst of requests on a new system prompt, the first to
        finish one that only hit it). One span a request
        (`HeadBlockStore.save_blocks`: four copies), freed once all its
        blocks are dropped; `token_ids` [max_len]: the request's tokens,
        each block's last row's next one saved with it."""
        num_blocks = min(len(block_ids), num_positions // self.block_size,
                         pool.capacity // self.block_size)
        first = next((b for b in range(unowned, num_blocks)
                      if int(block_ids[b]) not in self.store.blocks), num_blocks)
        span = slice(first * self.block_size, num_blocks * self.block_size)
        next_ids = None
        if token_ids is not None and num_blocks > first:  # the token after each block
            next_ids = token_ids[(first + 1) * self.block_size:
                                 num_blocks * self.block_size + 1:self.block_size]
        self.store.save_blocks(block_ids[first:num_blocks], pool.keys[slot, :, span],
                               pool.values[slot, :, span], pool.valid[slot, span], next_ids)

    def stats(self) -> dict[str, int]:
        """Prefix hits so far: requests that started on saved rows, those
        whose hit could not be adopted (with its positions), and of those
        the ones that took the rows from a request beside them."""
        return {"adopted": self.num_adopted, "missed": self.num_missed,
                "missed_positions": self.missed_positions, "filled": self.num_filled}

    def fill_missed(self, slot_of, pool, token_ids: torch.Tensor | None = None) -> list[int]:
        """After a step's prefill ingest: each request whose hit was missed
        takes its hit's rows from the slot of a request running beside it
        whose blocks start with the same ones and whose head ingested them
        (the request that filled them, this step or before: vLLM caches a
        block once it is scheduled). Its own rows' keys and values need no
        context: once the caller has ingested each one's last prefill row
        again (its output is the first draft's), the request drafts as on
        an adopted hit. `slot_of(req_id)`: a running request's state slot or
        None; `token_ids` [slots, max_len]: each slot's tokens (V2's
        `all_token_ids`), which keep the prefix's last row where the two
        have the same token after it (None: left out). Returns the slots
        filled."""
        filled = []
        for req_id, (slot, hit) in list(self.pending.items()):
            del self.pending[req_id]
            owner = self._owner(req_id, hit // self.block_size, slot_of)
            if owner is None:
                continue
            keep = (None if token_ids is None
                    else token_ids[owner, hit:hit + 1] == token_ids[slot, hit:hit + 1])
            pool.copy_prefix(owner, slot, hit, keep)
            filled.append(slot)
        self.num_filled += len(filled)
        return filled

    def _owner(self, req_id: str, num_blocks: int, slot_of) -> int | None:
        """The slot of a running request, other than `req_id`, whose head
        holds rows of `req_id`'s first `num_blocks` blocks (its own or
        adopted ones: none of them unowned); None if there is none."""
        blocks = self.block_ids.get(req_id, [])[:num_blocks]
        for other, ids in self.block_ids.items():
            if other != req_id and other not in self.unowned and ids[:num_blocks] == blocks:
                slot = slot_of(other)
                if slot is not None:
                    return int(slot)
        return None

    def adopt(self, req_id: str, slot: int, first_position: int, pool) -> bool:
        """Give new request `req_id` (state slot `slot`, first computed
        position `first_position`) its prefix's saved rows, the last one
        left out; True when it got them (its cache must then be kept below
        `first_position`)."""
        return bool(self.adopt_all([(req_id, slot, first_position)], pool)[0])

    def adopt_all(self, requests: list[tuple[str, int, int]], pool,
                  next_ids: torch.Tensor | None = None) -> np.ndarray:
        """`adopt` for (request, slot, first position) of several new
        requests, their rows written in a few launches together; `next_ids`
        [R]: each one's token at its first position (None: every prefix's
        last row left out). Returns which got them ([R] bool)."""
        adopted = np.zeros(len(requests), dtype=bool)
        slots, block_lists = [], []
        for r, (req_id, slot, first_position) in enumerate(requests):
            hit = self.hits.pop(req_id, 0)
            block_ids = self.block_ids.get(req_id, [])[:hit // self.block_size]
            if hit and hit == first_position and self.store.has_all(block_ids):
                adopted[r] = True
                slots.append(slot)
                block_lists.append(block_ids)
            elif hit:
                self.num_missed += 1
                self.missed_positions += hit
                self.unowned[req_id] = hit // self.block_size
                self.pending[req_id] = (slot, hit)
        if slots:
            tokens = None if next_ids is None else next_ids[to_device(
                np.flatnonzero(adopted), next_ids.device)]
            pool.adopt_slots(slots, *self.store.gather_many(block_lists, tokens))
            self.num_adopted += len(slots)
        return adopted
