"""`specplug_eagle3` / `specplug_mtp` on Model Runner V2: a `BaseSpeculator`
that drafts chains (`topk=1`) or EAGLE-2 trees on the device.

Model Runner V2 calls `propose` once per step, after verification and
`post_update`, and expects a [num_reqs, K] draft tensor on the device (K =
tree nodes - 1: a tree is handed over as its node list, parents first). The
step, with no host synchronisation:

1. Ingest. Each decoding request's verified positions (its first query row,
   then the accepted path: the tree sampler's `accepted_nodes`, or depth k
   for chains that vLLM's sampler verified) go into the head with the
   target's hidden states there, in one padded pass replayed as a CUDA
   graph (`verification/tree_rows.verified_rows`, `HeadRuntime.ingest_padded`).
   Prefill chunks, whose positions the host knows exactly, ingest eagerly.
2. Draft. Every request gets a tree from its root (the last sampled token at
   `total_len - 1`) in one graphed drafting pass; the node tokens are the
   drafts, and for trees the parents, depths and ancestor bits go to the
   request's state slot (`TreeSlots`) for the next step's layout.

A step asked for 0 drafts (a batch policy's or a table's length 0) runs
neither: the decodes' verified rows are kept on the device and ingested in
one pass before the next draft (`DeferredRows`), so that its cost comes
close to no speculation's.

When every request of the step decodes (the steady state), 1 and 2 are one
pass: a kernel writes the verified rows and the roots straight into
persistent buffers (`StepInputs`), the target's hidden states there are
gathered into another, and one graph replay ingests, drafts and writes the
drafts (`HeadRuntime.decode_step`). Host work is then about five launches.

The head's cache pool is addressed by Model Runner V2's state slots, so no
request bookkeeping is needed beyond knowing when a slot changed hands.
Failures go through the method's `ProposerGuard`: a failing head costs
speculation (drafts become the last token, verified as chains), never the
engine. The runtime, loading and guard are the V1 runner's too
(`head_drafter.HeadDrafter`).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_specplug.integration.config import ADAPTIVE_VERIFICATION_FIELD
from vllm_specplug.integration.head_drafter import HeadDrafter
from vllm_specplug.integration.ranges import profiled_range
from vllm_specplug.integration.batch_schedule import batch_draft_scheduled
from vllm_specplug.integration.v2.deferred_rows import MAX_KEPT_ROWS, DeferredRows
from vllm_specplug.integration.v2.grammar_parents import GrammarParents
from vllm_specplug.integration.v2.head_grammar import HeadGrammar
from vllm_specplug.integration.v2.head_rows import HeadRows
from vllm_specplug.integration.v2.path_ranks import PathRanks
from vllm_specplug.integration.v2.prefix_blocks import PrefixBlocks
from vllm_specplug.integration.v2.tree_slots import TreeSlots
from vllm_specplug.integration.v2.speculator import SpeculatorStats, V2SpeculatorHooks
from vllm_specplug.integration.v2.step_inputs import StepInputs, step_tree_shape
from vllm_specplug.integration.worker_rows import WORKER_ROWS_ATTR
from vllm_specplug.proposers.lookup import DeviceLookup
from vllm_specplug.proposers.head_graphs import padded_batch
from vllm_specplug.verification.backend import next_power_of_2

logger = logging.getLogger("vllm_specplug.tree_drafter")

# Share of the GPU's memory the head's cache pool takes at load, at most
# (max_num_seqs x max_model_len positions when they fit: 100 MB for
# SmolLM2's head at 64 x 2048; an 8B-shaped head's 4 KB a position at 256 x
# 8192 would be 8.6 GB, so it starts at what 4% holds and grows from there)
HEAD_POOL_MEMORY_SHARE = 0.04
# request ids of the steps Model Runner V2 runs to warm its kernels up after
# capturing its graphs (vllm/v1/worker/gpu/warmup.py): the head's captures
# there are still start-up's, not stalls in service
WARMUP_REQ_PREFIXES = ("_warmup_", "_v2_mixed_warmup")


class SpecplugV2HeadSpeculator(HeadRows, HeadGrammar, V2SpeculatorHooks):
    def __init__(self, vllm_config, device: torch.device, req_states) -> None:
        self.vllm_config = vllm_config
        self.drafter = HeadDrafter(vllm_config)
        self.method = self.drafter.method
        self.req_states = req_states
        self.device = device
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.num_speculative_steps = vllm_config.speculative_config.num_speculative_tokens
        # positions the head's pool may hold per request (a step's drafts included)
        self.max_positions = (vllm_config.model_config.max_model_len
                              + self.num_speculative_steps + 1)
        num_nodes = self.drafter.options.num_draft_tokens
        # one slot past the requests': the fused step's padded rows store
        # their trees there (`_emit`), not in the slot of the request they repeat
        self.tree_slots = (TreeSlots(self.max_num_reqs + 1, num_nodes, device)
                           if self.drafter.is_tree else None)
        self.grammar_parents = (GrammarParents(device) if self.tree_slots is not None
                                and device.type == "cuda" else None)
        # rows past max_num_reqs: a fused step's padding writes there (see _emit)
        self.drafts = torch.zeros(padded_batch(self.max_num_reqs), self.num_speculative_steps,
                                  dtype=torch.int64, device=device)
        self.step_inputs = StepInputs(padded_batch(self.max_num_reqs),
                                      next_power_of_2(self.drafter.options.verified_depth + 1),
                                      device)
        self._init_adaptive_verification(vllm_config.speculative_config, device)
        self.slot_req_ids = np.full(self.max_num_reqs, None, dtype=object)  # [S]
        self.stats = SpeculatorStats(device)
        self.service_compiles = None  # our kernels compiled after capture() (kernel_warmup.py)
        self.runtime = None
        cache = vllm_config.cache_config
        # the head's rows of the target's cached blocks (prefix_blocks.py)
        self.prefix = (PrefixBlocks(cache.block_size) if cache.enable_prefix_caching
                       else None)
        options = self.drafter.options
        self._init_grammar(vllm_config, options)
        # trees under our batch policy: each step's accepted paths' node
        # ranks go to the scheduler, which learns every smaller tree from them
        self.path_ranks = (PathRanks(self.max_num_reqs, num_nodes, device)
                           if self.tree_slots is not None
                           and batch_draft_scheduled(vllm_config) else None)
        # steps asked for 0 drafts keep their verified rows for the head's
        # next draft instead of running its pass (deferred_rows.py)
        # (room for a step's verified rows, a deep lookup's branch included)
        kept_rows = max(MAX_KEPT_ROWS, next_power_of_2(options.verified_depth + 1))
        self.deferred = (DeferredRows(self.max_num_reqs, device, kept_rows)
                         if 0 in self._scheduled_lengths() else None)
        self.stats.deferred = self.deferred
        # prompt lookups where the history repeats (lookup.py): a chain's
        # drafts, a tree's extra branch
        self.lookup = (DeviceLookup(options.prompt_lookup_min, options.prompt_lookup_max,
                                    self.max_num_reqs, vllm_config.model_config.max_model_len,
                                    options.lookup_num_tokens if self.tree_slots is not None
                                    else self.num_speculative_steps, device)
                       if options.prompt_lookup_min else None)

    def _scheduled_lengths(self) -> tuple[int, ...]:
        from vllm_specplug.integration.v2.step_warmup import scheduled_lengths

        return scheduled_lengths(self.vllm_config.speculative_config)

    def _init_adaptive_verification(self, spec_config, device: torch.device) -> None:
        """vLLM's adaptive verification (`enable_adaptive_verification`, chains
        only): `DraftConfidences` fills the confidences vLLM's manager ranks."""
        self.enable_adaptive_verification = bool(
            getattr(spec_config, ADAPTIVE_VERIFICATION_FIELD, False))
        self.confidences = None
        # rows past max_num_reqs: a padded pass's last rows write there
        num_rows = padded_batch(self.max_num_reqs)
        if not self.enable_adaptive_verification:  # vLLM reads them only when it is on
            self.draft_token_confidence_probs = torch.ones(
                num_rows, self.num_speculative_steps, dtype=torch.float32, device=device)
            return
        if self.drafter.is_tree:
            raise ValueError(f"{self.method}: {ADAPTIVE_VERIFICATION_FIELD} needs a chain "
                             "(topk=1); a tree verifies every node it keeps")
        from vllm_specplug.integration.v2.draft_confidences import DraftConfidences

        self.confidences = DraftConfidences(self.max_num_reqs, self.num_speculative_steps,
                                            num_rows, device)
        self.draft_token_confidence_probs = self.confidences.confidence_probs

    @property
    def acceptance_estimator(self):
        """vLLM's estimator behind our confidences (None: adaptive verification off)."""
        return None if self.confidences is None else self.confidences.estimator

    @property
    def guard(self):
        return self.drafter.guard

    @property
    def failure_counts(self) -> dict[str, int]:
        return self.guard.failure_counts

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        return self.drafter.aux_layer_ids

    def attach(self, target_model, model_state, attention_layers: dict) -> None:
        """After the target is loaded: the head on the device (sharing the
        target's embedding), and for trees the tree slots bound to the model
        state and to every attention layer (tree attention)."""
        from vllm_specplug.integration import cuda_tree_attention

        self.runtime = self.drafter.load_model(target_model, self.max_num_reqs)
        pool = self.runtime.make_pool(self.max_num_reqs, self.drafter.draft_dtype, self.device)
        # Sized now, while the engine has not yet measured its memory: the
        # pool counts as the model's, not taken from the KV cache later.
        # Growing in service would hold two pools at once and recapture every
        # graph of the head (each first step at a new size stalled).
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            pool.preallocate(self.max_num_reqs, self.max_positions,
                             int(HEAD_POOL_MEMORY_SHARE * total))
        if self.confidences is not None:
            self.runtime.draft_logits_hook = self.confidences.predict
        if self.drafter.options.masks_drafts() \
                and self.drafter.options.masks_first_step_only(model_runner_v2=True):
            self._attach_root_masks()
        if self.tree_slots is None:
            return
        if self.path_ranks is not None:  # before any graph of the head is captured
            self.runtime.rank_nodes = True
            self.tree_slots.keep_ranks()
        if not hasattr(model_state, "bind"):
            raise RuntimeError(f"{self.method} trees: the target runs under "
                               f"{type(model_state).__name__}, not vllm-specplug's tree model "
                               "state; use topk=1 (a chain) for this model")
        model_state.bind(self.tree_slots, self.grammar_choices)
        self.tree_slots.split_attention = self.drafter.options.tree_attention == "split"
        cuda_tree_attention.attach(attention_layers, self.tree_slots)

    @torch.inference_mode()
    def capture(self) -> None:
        """Model Runner V2 captures its graphs: ours too, the fused decode
        step's for every padded batch size and draft length it may run
        (step_warmup.py), so that no step in service stalls on a capture,
        and the tree step's eager kernels compiled (kernel_warmup.py). A
        failure costs those graphs or compiles (done on first use instead),
        never the engine."""
        from vllm_specplug.integration.v2.kernel_warmup import (ServiceCompiles,
                                                                warm_up_prefill_attention,
                                                                warm_up_tree_kernels)
        from vllm_specplug.integration.v2.step_warmup import (step_keys, table_of, target_layout,
                                                              warm_up_kept_rows,
                                                              warm_up_mixed_passes,
                                                              warm_up_step_graphs)

        if self.runtime is None or self.runtime.graphs is None or self.guard.disabled:
            return
        started = time.perf_counter()
        layout = target_layout(self.vllm_config.model_config, self.drafter.aux_layer_ids)
        lengths = drafted = self._scheduled_lengths()
        if self.deferred is not None:  # a step at 0 drafts keeps its rows: no pass to capture
            drafted = tuple(k for k in lengths if k > 0)
            self.guard.call("capture", [], warm_up_kept_rows, self, lengths, *layout,
                            effect="kept rows are kept eagerly, ingested by graphs captured "
                            "on first use")
        keys = step_keys(drafted, table_of(self.vllm_config), self.drafter.tree_shape,
                         step_tree_shape, self.max_num_reqs, self.drafter.options.verified_depth)
        # (after the kept rows' warm-up: this one clears the head's cache)
        ok, count = self.guard.call("capture", [], warm_up_step_graphs, self, keys, *layout,
                                    effect="its graphs are captured on first use")
        if ok:
            logger.info("vllm-specplug %s: %d decode-step graphs of the head captured in "
                        "%.1f s", self.method, count, time.perf_counter() - started)
        self.guard.call("capture", [], warm_up_mixed_passes, self, keys, *layout,
                        effect="a step with prefills captures the head's passes on first use")
        if self.lookup is not None:  # prompt lookups' kernels (proposers/lookup.py)
            sizes = tuple(sorted({step_tree_shape(self.drafter.tree_shape, k)[2]
                                  for k in drafted}))
            self.guard.call("capture", [], self.lookup.warm_up, self.req_states.all_token_ids.gpu,
                            self.req_states.total_len.gpu, self.drafts, self.tree_slots, sizes,
                            effect="they compile on first use")
        if self.tree_slots is not None:  # the tree step's eager kernels (kernel_warmup.py)
            self.guard.call("capture", [], warm_up_tree_kernels, self.tree_slots, lengths,
                            self.drafter.options.verified_depth,
                            effect="they compile on first use")
        self.guard.call("capture", [], warm_up_prefill_attention, self.runtime,
                        effect="the head's eager ingest compiles its attention on first use")
        if self.service_compiles is None:  # one hook, should vLLM capture again
            self.service_compiles = ServiceCompiles()
            self.guard.call("capture", [], self.service_compiles.watch,
                            effect="kernels compiled in service go uncounted")

    @torch.inference_mode()
    def schedule(self, scheduler_output, req_states) -> None:
        """Before Model Runner V2 applies a scheduler output (our runner
        patch calls it): the structured requests' params, and the prefix
        blocks' bookkeeping."""
        if self.structured is not None:
            self.structured.schedule(scheduler_output)
        self.worker_rows_req_ids = list(getattr(scheduler_output, WORKER_ROWS_ATTR, None) or ())
        if self.prefix is None or self.runtime is None or self.guard.disabled:
            return
        finished = scheduler_output.finished_req_ids
        self.guard.call("schedule", finished, self.prefix.schedule, scheduler_output,
                        req_states.req_id_to_index.get,
                        lambda slot: int(req_states.num_computed_tokens_np[slot]),
                        self.runtime.pool, req_states.all_token_ids.gpu)

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        num_reqs = input_batch.num_reqs
        drafts = self.drafts[:num_reqs]
        if dummy_run or self.runtime is None:  # profiling, warm-up, DP padding
            return drafts
        started = time.perf_counter()
        graphs = self.runtime.graphs
        if graphs is not None and not graphs.in_service and num_reqs \
                and not input_batch.req_ids[0].startswith(WARMUP_REQ_PREFIXES):
            graphs.in_service = True  # a capture from now on stalls a step
        if self.path_ranks is not None and input_batch.num_draft_tokens > 0 \
                and self.path_ranks.due(self.sample_every):
            # before this step's trees replace the ranks of those just verified
            self.guard.call("path_ranks", input_batch.req_ids, self.path_ranks.record_step,
                            input_batch, self.tree_slots, effect="the batch policy learns "
                            "this step's smaller tree sizes from their own steps only")
        if self.structured is not None:
            self.structured.begin_step()
        if self.confidences is not None and not self.guard.disabled:
            self.guard.call("observe_verification", input_batch.req_ids,
                            self.confidences.observe, input_batch.idx_mapping, num_sampled,
                            num_rejected, temperature)
        shape = step_tree_shape(self.drafter.tree_shape, num_speculative_tokens)
        ok, unmasked = (False, False) if self.guard.disabled else self.guard.call(
            "propose", input_batch.req_ids, self._step, input_batch,
            last_hidden_states, aux_hidden_states, num_rejected, last_sampled.view(-1),
            next_prefill_tokens, drafts, shape, num_speculative_tokens)
        if ok and (unmasked or self.tree_slots is not None) and self.lookup is not None:
            with profiled_range("specplug::lookup"):
                self.guard.call("lookup", input_batch.req_ids, self._look_up, input_batch,
                                num_sampled, drafts, shape[2],
                                effect="this step keeps the head's drafts")
        if not ok:  # failed or switched off: last-token drafts, verified as chains
            slots = input_batch.idx_mapping[:num_reqs]
            drafts.copy_(last_sampled.view(-1)[slots][:, None].expand_as(drafts))
            if self.tree_slots is not None:
                self.tree_slots.forget(slots)
        if self.grammar_parents is not None:
            self._keep_parents_for_grammar(input_batch)
        self.stats.host_seconds += time.perf_counter() - started
        self.stats.num_steps += 1
        return drafts

    def _look_up(self, input_batch, num_sampled, drafts, num_nodes: int) -> None:
        """Prompt lookups where a history repeats (proposers/lookup.py): in
        place of a chain, or as a branch of a tree."""
        args = (input_batch.req_ids, self.req_states.all_token_ids.gpu,
                input_batch.idx_mapping, self.req_states.total_len.gpu, num_sampled, drafts)
        if self.tree_slots is None:
            self.lookup.merge(*args)
        else:
            self.lookup.graft(*args, self.tree_slots, num_nodes)

    @property
    def scans_token_histories(self) -> bool:
        return self.lookup is not None  # prompt lookups scan every history

    def lookup_stats(self) -> dict[str, int] | None:
        """Requests and nodes drafted by prompt lookups so far (None: off)."""
        return None if self.lookup is None else self.lookup.stats()

    def take_path_ranks(self):
        """(drafts per request, ranks) of a step before this one (PathRanks), or None."""
        return self.path_ranks.take() if self.path_ranks is not None else None

    def _step(self, input_batch, hidden, aux, num_rejected, last_sampled, next_prefill,
              drafts, shape: tuple[int, int, int], num_drafts: int | None) -> bool:
        """One step's ingest and drafts; True where they were drafted
        without grammar masks (prompt lookups may then replace chains)."""
        num_reqs = input_batch.num_reqs
        slots_np = input_batch.idx_mapping_np[:num_reqs]
        req_ids = np.asarray(input_batch.req_ids[:num_reqs], dtype=object)
        new = (self.slot_req_ids[slots_np] != req_ids).astype(bool)
        self.slot_req_ids[slots_np] = req_ids
        max_position = int(input_batch.seq_lens_cpu_upper_bound[:num_reqs].max())
        self.runtime.pool.reserve(self.max_num_reqs, max_position + 1)
        prefill = input_batch.is_prefilling_np[:num_reqs] | new
        if self.prefix is not None and new.any():
            self._adopt_prefixes(input_batch, np.flatnonzero(new), new)
        if self.deferred is not None:
            self.deferred.drop(slots_np[prefill])  # a prefill ingests its own positions
            if num_drafts == 0:  # nothing to draft: keep the decodes' rows for later
                self.queue_for_rows(input_batch)
                with profiled_range("specplug::keep_rows"):
                    self._keep_step(input_batch, prefill, new, hidden, aux, num_rejected,
                                    last_sampled, next_prefill)
                return False
            with profiled_range("specplug::ingest_kept"):  # before this step's own rows
                self.deferred.flush(self.runtime, slots_np[~prefill], max_position)
        masks = self._grammar_masks(input_batch)
        if not prefill.any() and masks is None:  # every request decodes: one pass
            with profiled_range("specplug::decode_step"):  # ranges for `bench offline --phases`
                self._decode_step(input_batch, hidden, aux, num_rejected, last_sampled,
                                  max_position, shape)
            return True
        with profiled_range("specplug::ingest"):
            if (~prefill).any():
                self._ingest_decodes(input_batch, np.flatnonzero(~prefill), hidden, aux,
                                     num_rejected, last_sampled, max_position)
            if prefill.any():  # else: decodes drafted apart, under grammar masks
                self._ingest_prefills(input_batch, np.flatnonzero(prefill), new, hidden, aux,
                                      last_sampled, next_prefill)
        with profiled_range("specplug::draft_tree"):
            self._draft(input_batch, last_sampled, max_position + 1, drafts, shape, masks)
        return masks is None

    def _decode_step(self, input_batch, hidden, aux, num_rejected, last_sampled,
                     max_position: int, shape: tuple[int, int, int]) -> None:
        """A step where every request decodes: its verified rows and roots
        (one kernel) and the target's hidden states there are written into
        persistent buffers, padded to a capture size; the head ingests and
        drafts in one graph replay that reads them in place (`_emit` writes
        the drafts inside it)."""
        num_rows = self._num_verified_rows(input_batch, slice(input_batch.num_reqs))
        rows, target = self._step_rows(input_batch, hidden, aux, num_rejected, last_sampled,
                                       num_rows)
        self.runtime.decode_step(rows.slots, target, rows.next_ids, rows.positions, rows.cuts,
                                 rows.root_ids, rows.root_positions, max_position + 1,
                                 shape, self._emit)

    def _emit(self, slots: torch.Tensor, tree) -> None:
        """Inside the fused step's pass: drafts of the padded batch (rows past
        num_reqs are never read), and the trees for the next step's layout
        (the padding's in the spare slot: `StepInputs.stored_slots`)."""
        self.drafts[:slots.shape[0], :tree.num_nodes - 1].copy_(tree.token_ids[:, 1:])
        if self.tree_slots is not None:
            self.tree_slots.store(self.step_inputs.stored_slots(slots, self.max_num_reqs),
                                  tree, True)

    def _draft(self, input_batch, last_sampled, num_keys: int, drafts,
               shape: tuple[int, int, int], masks=None) -> None:
        num_reqs = input_batch.num_reqs
        slots = input_batch.idx_mapping[:num_reqs]
        roots = last_sampled[slots]
        root_positions = self.req_states.total_len.gpu[slots].long() - 1
        self.runtime.tree_logits_hook = masks
        try:
            tree = self.runtime.draft_slots(slots, roots, root_positions, num_keys, *shape)
        finally:
            self.runtime.tree_logits_hook = None
        drafts[:, :tree.num_nodes - 1].copy_(tree.token_ids[:, 1:])
        if self.tree_slots is not None:
            self.tree_slots.store(slots, tree, True)
