"""The verified rows a Model Runner V2 step hands the EAGLE-3/MTP head
(`SpecplugV2HeadSpeculator`): ingested now (decoding requests in one padded
graphed pass, prefill chunks eagerly), or kept for later when the step asks
for 0 drafts (`DeferredRows`)."""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.proposers.head_graphs import padded_batch
from vllm_specplug.verification.backend import to_device
from vllm_specplug.verification.tree_rows import rows_per_request, verified_rows


class HeadRows:
    """Mixin of `SpecplugV2HeadSpeculator`: reads its runtime, drafter,
    step inputs, tree slots, kept rows and prefix blocks."""

    def _keep_step(self, input_batch, prefill: np.ndarray, new: np.ndarray, hidden, aux,
                   num_rejected, last_sampled, next_prefill) -> None:
        """A step asked for 0 drafts: the decoding requests' verified rows go
        to the store (`DeferredRows.keep`, flushed first where a slot's is
        full), prefill chunks are ingested as always, and no draft is made
        (vLLM schedules none). When every request decodes, the rows are laid
        out in the fused step's persistent buffers and kept by one graph
        replay (the step's host work is then about that of the fused step)."""
        decoding = np.flatnonzero(~prefill)
        if len(decoding):
            slots = input_batch.idx_mapping_np[decoding]
            num_rows = self._num_verified_rows(input_batch, decoding)
            if not self.deferred.has_room(slots, num_rows):
                max_position = int(input_batch.seq_lens_cpu_upper_bound[decoding].max())
                self.deferred.flush(self.runtime, slots, max_position)
            if len(decoding) == input_batch.num_reqs:
                rows, target = self._step_rows(input_batch, hidden, aux, num_rejected,
                                               last_sampled, num_rows)
                self.deferred.keep(rows, target, slots, self.runtime.graphs,
                                   self.runtime.pool.version)
            else:
                rows = self._verified(input_batch, to_device(decoding, self.device),
                                      num_rejected, last_sampled, num_rows)
                self.deferred.keep(rows, self.drafter.target_hidden(hidden, aux,
                                                                    rows.token_rows), slots)
        if prefill.any():
            self._ingest_prefills(input_batch, np.flatnonzero(prefill), new, hidden, aux,
                                  last_sampled, next_prefill)

    def _step_rows(self, input_batch, hidden, aux, num_rejected, last_sampled,
                   num_rows: int):
        """A decode-only step's verified rows (`num_rows` a request) and the
        target's hidden states there, written into the persistent buffers
        (`StepInputs`) padded to a capture size: (VerifiedRows, [P * R, W])."""
        num_reqs = input_batch.num_reqs
        size = padded_batch(num_reqs)
        rows = self.step_inputs.rows(size, num_rows)
        self.step_inputs.num_requests.fill_(num_reqs)  # the rows past it: padding
        self._verified(input_batch, self.step_inputs.batch_rows[:num_reqs], num_rejected,
                       last_sampled, num_rows, size, out=rows)
        target = self.step_inputs.hidden(size * num_rows,
                                         *self.drafter.target_layout(hidden, aux))
        self.drafter.target_hidden(hidden, aux, rows.token_rows, out=target)
        return rows, target

    def _num_verified_rows(self, input_batch, rows: np.ndarray | slice) -> int:
        """Rows a step's verified positions take per request (`rows`: the
        batch rows, a slice for the whole batch), `rows_per_request`."""
        return rows_per_request(int(input_batch.num_scheduled_tokens[rows].max()),
                                self.drafter.options.verified_depth)

    def _verified(self, input_batch, batch_rows: torch.Tensor, num_rejected, last_sampled,
                  num_rows: int, num_padded: int | None = None, out=None):
        """`verified_rows` of the requests at `batch_rows` [P] (device)."""
        verified_trees = self.tree_slots is not None and input_batch.num_draft_tokens > 0
        return verified_rows(batch_rows, input_batch.query_start_loc, input_batch.seq_lens,
                             num_rejected, input_batch.cu_num_logits, input_batch.idx_mapping,
                             self.tree_slots.accepted_nodes if verified_trees else None,
                             input_batch.input_ids, last_sampled, num_rows, num_padded, out=out)

    def _adopt_prefixes(self, input_batch, rows: np.ndarray, new: np.ndarray) -> None:
        """Requests new to their slot that start on cached blocks get the
        head's saved rows of them, and keep them (no longer `new`)."""
        first = input_batch.num_computed_prefill_tokens_np
        # each one's token at its first position: its prefix's last saved row
        # stays where the request that saved it had the same token there
        starts = input_batch.query_start_loc_np[rows].astype(np.int64)
        next_ids = input_batch.input_ids[to_device(starts, self.device)]
        adopted = self.prefix.adopt_all(
            [(input_batch.req_ids[row], int(input_batch.idx_mapping_np[row]), int(first[row]))
             for row in rows], self.runtime.pool, next_ids)
        new[rows[adopted]] = False

    def _ingest_decodes(self, input_batch, rows: np.ndarray, hidden, aux, num_rejected,
                        last_sampled, max_position: int) -> None:
        """Decoding requests' verified positions, padded, in one graphed pass."""
        layout = self._verified(input_batch, to_device(rows, self.device), num_rejected,
                                last_sampled, self._num_verified_rows(input_batch, rows))
        target = self.drafter.target_hidden(hidden, aux, layout.token_rows)
        self.runtime.ingest_padded(layout.slots, target, layout.next_ids, layout.positions,
                                   layout.cuts, max_position)

    def _ingest_prefills(self, input_batch, rows: np.ndarray, new: np.ndarray, hidden, aux,
                         last_sampled, next_prefill) -> None:
        """Prefill chunks (and requests new to their slot), eagerly: each
        query row at its position, followed by the next prompt token, or by
        the sampled token after a prompt's last chunk."""
        counts = input_batch.num_scheduled_tokens[rows].astype(np.int64)
        starts = input_batch.query_start_loc_np[rows].astype(np.int64)
        first = input_batch.num_computed_prefill_tokens_np[rows].astype(np.int64)
        token_rows = np.concatenate([s + np.arange(c) for s, c in zip(starts, counts)])
        positions = np.concatenate([f + np.arange(c) for f, c in zip(first, counts)])
        last = np.cumsum(counts) - 1
        done = first + counts >= input_batch.prefill_len_np[rows]  # the prompt's last chunk
        device_rows = to_device(token_rows, self.device)
        next_ids = input_batch.input_ids[(device_rows + 1).clamp_(
            max=input_batch.input_ids.shape[0] - 1)].long()
        slots = input_batch.idx_mapping[to_device(rows, self.device)]
        after = torch.where(to_device(done, self.device), last_sampled[slots],
                            next_prefill[0, slots].long())
        next_ids[to_device(last, self.device)] = after
        target = self.drafter.target_hidden(hidden, aux, device_rows)
        slots_np = input_batch.idx_mapping_np[rows].astype(np.int64)
        self.runtime.ingest_slots(slots_np, new[rows], target, next_ids, positions,
                                  counts.tolist())
        if self.prefix is not None and self.prefix.pending:  # hits missed this step
            self._fill_missed_prefixes(slots_np, last, target, next_ids, positions)

    def _fill_missed_prefixes(self, slots: np.ndarray, last: np.ndarray, target,
                              next_ids: torch.Tensor, positions: np.ndarray) -> None:
        """The prefill ingest's requests whose hit was missed take its rows
        from a request running beside them (`PrefixBlocks.fill_missed`),
        then ingest their last row again, over the whole prefix now (its
        output is their first draft's). `slots` [R] host, `last` [R]: each
        one's last row among the ingest's rows (target, next_ids on the
        device; positions on the host)."""
        filled = self.prefix.fill_missed(self.req_states.req_id_to_index.get,
                                         self.runtime.pool, self.req_states.all_token_ids.gpu)
        if not filled:
            return
        again = np.flatnonzero(np.isin(slots, filled))
        index = to_device(last[again], self.device)
        self.runtime.ingest_slots(slots[again], np.zeros(len(again), dtype=bool), target[index],
                                  next_ids[index], positions[last[again]], [1] * len(again))
