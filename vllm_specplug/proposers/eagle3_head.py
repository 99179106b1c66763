"""Inference of a one-layer drafter: ingest verified positions, draft EAGLE-2
trees. The drafter is an EAGLE-3 head (`draft_models/eagle3_model.py`, vLLM's
`llama_eagle3.py` layout) or an MTP layer (`draft_models/mtp_model.py`, vLLM's
`mimo_mtp`), behind `draft_layers.py`.

The runtime keeps the drafter's KV cache per request (a slot of one pool,
`head_cache.py`): one K/V row per verified position t, computed from (the
target's hidden state at t: EAGLE-3's fc(aux layers), MTP's last layer;
embed(token t+1)) at rope position t. Drafting (EAGLE-2, arXiv 2406.16858) starts from
the output at the last verified position: its top-k are the depth-1 nodes;
expanding a depth-d node runs the layer on (its parent's output, embed(node))
at position root + d - 1, attending to the request's cache plus the keys of
its own ancestors in the draft (tree attention), and pools the k*k children
by path log-probability; the best k are expanded next. Draft K/V rows are
never stored: after verification the accepted positions are ingested with the
target's hidden states, as vLLM's eagle3 does. A drafting pass has fixed
shapes for a (batch, context bucket, tree shape), so on CUDA it replays as
one captured graph (`head_graphs.py`); so does a decode step's ingest (every
request cached before, a few positions each), padded to fixed shapes.

Shapes: B requests, k = topk, nh query heads, kvh KV heads (g = nh / kvh per
group), hd head size, H head hidden size, Vd draft vocabulary.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import torch

from vllm_specplug.proposers.draft_compile import compiled_steps
from vllm_specplug.proposers.draft_layers import as_draft_layer
from vllm_specplug.proposers.draft_topk import draft_topk
from vllm_specplug.proposers.head_attention import attend_cached, attend_draft, draft_context
from vllm_specplug.proposers.head_cache import MIN_SLOTS, NO_POSITION, CacheView, HeadCachePool
from vllm_specplug.proposers.head_graphs import (PassGraphs, decode_ingest_layout, key_range,
                                                  padded, padded_batch, run_draft_pass,
                                                  run_ingest_pass, run_step_pass)
from vllm_specplug.verification.backend import Backend, to_device
from vllm_specplug.verification.metadata import ROOT_PARENT, DraftTree
from vllm_specplug.verification.tree_ranks import score_ranks
from vllm_specplug.verification.tree_build import (build_draft_tree, chain_tree,
                                                   extend_draft_pool,
                                                   next_beam)


ATTENTION_ELEMENTS = 1 << 27  # score elements per ingest group (float32: 512 MiB)
NO_QUERY = -1  # position of a padding query row (sees no key; its output is dropped)


def _groups(counts: list[int], num_keys: list[int], num_heads: int) -> list[list[int]]:
    """Consecutive request groups whose padded score tensor stays under
    ATTENTION_ELEMENTS (a request alone may exceed it)."""
    groups, current, max_q, max_k = [], [], 0, 0
    for r, (num_q, num_k) in enumerate(zip(counts, num_keys)):
        grown = (len(current) + 1) * max(max_q, num_q) * max(max_k, num_k) * num_heads
        if current and grown > ATTENTION_ELEMENTS:
            groups.append(current)
            current, max_q, max_k = [], 0, 0
        current.append(r)
        max_q, max_k = max(max_q, num_q), max(max_k, num_k)
    return groups + [current] if current else groups


def _pad_host(arrays: list[np.ndarray], fill: int) -> np.ndarray:
    """[G, max len] int64 from ragged host arrays."""
    out = np.full((len(arrays), max(len(a) for a in arrays)), fill, dtype=np.int64)
    for g, array in enumerate(arrays):
        out[g, :len(array)] = array
    return out


class HeadRuntime:
    def __init__(self, head, embed: Callable[[torch.Tensor], torch.Tensor],
                 draft_temperature: float = 1.0, num_slots: int = MIN_SLOTS,
                 cuda_graphs: bool = False, attention_backend: Backend = "auto",
                 compile_steps: bool = False):
        """head: an `Eagle3Head` or a `draft_layers` drafter (MTP). num_slots:
        requests the cache pool is first sized for (it grows). cuda_graphs:
        run each drafting pass as a captured CUDA graph (CUDA only).
        attention_backend: the attention over the cache (`head_attention.py`;
        `auto`: the Triton kernel on CUDA, einsums over copied keys elsewhere).
        compile_steps: the layer's dense steps through `torch.compile`
        (`draft_compile.py`)."""
        self.layer = as_draft_layer(head)
        # on CUDA "auto" is the Triton kernel, which stops at its rows' positions
        self.graphs = (PassGraphs(positions_bound_keys=attention_backend != "torch")
                       if cuda_graphs else None)
        # with graphs, compiled steps serve captured passes only (no compile in service)
        serves = (lambda: self.graphs.capturing) if self.graphs is not None else None
        steps = compiled_steps(self.layer, serves) if compile_steps else {}
        self.compiled_steps = steps
        self._qkv_step = steps.get("qkv", self.layer.qkv)
        self._finish = steps.get("finish", self.layer.finish)
        self._logits_step = steps.get("logits", self.layer.logits)
        self.draft_temperature = draft_temperature
        self.embed = embed  # target token ids [T] -> [T, H] (the target's embedding)
        self.scale = self.layer.head_dim ** -0.5
        self.group = self.layer.num_heads // self.layer.num_kv_heads  # query heads per KV head
        self.num_slots = num_slots
        self.pool: HeadCachePool | None = None  # made at the first ingest (dtype, device)
        self.attention_backend = attention_backend
        # Called inside a chain's drafting pass with each draft step's logits
        # (logits [B, V_draft], slots [B], draft step d): a runner's
        # acceptance estimate (vLLM's adaptive verification) reads them
        # there, in the same graph. Set it before the first pass.
        self.draft_logits_hook: Callable[[torch.Tensor, torch.Tensor, int], None] | None = None
        # trees carry their nodes' ranks by path score (DraftTree.score_ranks),
        # for the batch policy on Model Runner V2; set before graphs are captured
        self.rank_nodes = False
        # Called in a tree's drafting pass (eager) with each step's logits
        # before its top-k: (logits [B, V_draft] at step 0, [B, k, V_draft]
        # after; slots [B]; the candidates pooled so far, None at step 0;
        # the beam's pooled ids [B, k], None at step 0), returning the logits
        # to take the top-k of. What a grammar-aware drafter masks with
        # (benchmarks/bench_grammar_drafting.py).
        self.tree_logits_hook: Callable | None = None
        # Applied in every drafting pass, graphed ones too, to the first
        # step's logits [B, V_draft] (rows in the pass's batch order), returning
        # the logits to rank: device work only, no sync. Model Runner V2's
        # first-step grammar masks (integration/v2/root_masks.py). Set it
        # before graphs are captured.
        self.first_logits_mask: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forget(self, req_id: str) -> None:
        if self.pool is not None:
            self.pool.release(req_id)

    def last_position(self, req_id: str) -> int:
        return NO_POSITION if self.pool is None else self.pool.last_position(req_id)

    def cache_of(self, req_id: str) -> CacheView:
        return self.pool.view(req_id)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(token_ids).to(self.layer.dtype)

    def _qkv(self, embeds, hidden, positions, rope=None):
        """[R, H] inputs at positions [R] -> q [R, nh, hd], k, v [R, kvh, hd]
        (roped q, k) and the residual base [R, H]. rope: the positions'
        (cos, sin) [R, hd], when already computed."""
        return self._qkv_step(embeds, hidden, positions, rope)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self._logits_step(out)

    @torch.inference_mode()
    def ingest(self, req_id: str, target_hidden: torch.Tensor, next_token_ids: torch.Tensor,
               positions: torch.Tensor) -> None:
        """Verified positions [T] (ascending) with the target's hidden states
        there (EAGLE-3: aux layers [T, L*H_t]; MTP: last layer [T, H]) and
        the token after each [T]. Cache rows at or after positions[0] are
        replaced (a recomputed or resumed request)."""
        self.ingest_many([req_id], target_hidden, next_token_ids, positions,
                         [positions.shape[0]])

    @torch.inference_mode()
    def ingest_many(self, req_ids: list[str], target_hidden: torch.Tensor,
                    next_token_ids: torch.Tensor, positions: torch.Tensor,
                    counts: list[int]) -> None:
        """`ingest` for several requests in one pass of the layer: their rows
        are concatenated in `req_ids` order, `counts[r]` (>= 1) rows each
        ([T, *], [T], [T]). K/V rows go into the pool in place; attention
        runs over the pool's slots of a group of requests at once (groups
        bounded by ATTENTION_ELEMENTS, so a batch of prefills fits). Cache
        bookkeeping runs on host copies of the positions: no device sync."""
        host_positions = positions.cpu().numpy().astype(np.int64)
        pool = self.pool
        if self.graphs is not None and pool is not None:
            layout = decode_ingest_layout(pool, req_ids, host_positions, counts)
            if layout is not None:  # a decode step: fixed shapes, replayed as a graph
                run_ingest_pass(self.graphs, self._ingest_pass, pool, layout,
                                target_hidden, next_token_ids)
                return
        if pool is None:
            pool = self.make_pool(self.num_slots, self.layer.dtype, target_hidden.device)
        slots, new = pool.assign(req_ids)
        self.ingest_slots(slots, new, target_hidden, next_token_ids, host_positions, counts)

    def make_pool(self, num_slots: int, dtype: torch.dtype, device) -> HeadCachePool:
        """The cache pool, made now (the first ingest makes it otherwise)."""
        layer = self.layer
        self.pool = HeadCachePool(layer.num_kv_heads, layer.head_dim, layer.hidden_size,
                                  layer.logits_size, dtype, device, num_slots)
        return self.pool

    @torch.inference_mode()
    def ingest_slots(self, slots: np.ndarray, new: np.ndarray, target_hidden: torch.Tensor,
                     next_token_ids: torch.Tensor, host_positions: np.ndarray,
                     counts: list[int]) -> None:
        """Ragged ingest into given pool slots ([R] host; `new` [R] bool: the
        slot forgets what it held), `counts[r]` rows each, positions on the
        host ([T]). Eager: prefills, new requests. Rows as `ingest_many`."""
        hidden = self.layer.input_hidden(target_hidden)
        positions = to_device(host_positions, hidden.device)
        q, k, v, base = self._qkv(self._embed(next_token_ids), hidden, positions)
        pool = self.pool
        starts = np.array([0, *itertools.accumulate(counts)])
        cuts = np.where(new, 0, host_positions[starts[:-1]])  # a new slot forgets all
        pool.store(slots, cuts, np.repeat(slots, counts), host_positions, k, v)
        attn = torch.empty_like(q)
        num_keys = (host_positions[starts[1:] - 1] + 1).tolist()
        for group in _groups(counts, num_keys, q.shape[1]):
            rows = slice(starts[group[0]], starts[group[-1] + 1])
            attn[rows] = self._attend(q[rows], slots[group], [
                host_positions[starts[r]:starts[r + 1]] for r in group])
        out = self._finish(attn.reshape(attn.shape[0], -1), base)
        # indexed on the device: a host index array would copy synchronously
        # and hold the host behind the GPU every step with a prefill
        last = out[to_device(starts[1:] - 1, out.device)]
        pool.set_last(to_device(slots, pool.device), last, self._logits(last))

    @torch.inference_mode()
    def ingest_padded(self, slots: torch.Tensor, target_hidden: torch.Tensor,
                      next_token_ids: torch.Tensor, positions: torch.Tensor,
                      cuts: torch.Tensor, max_position: int) -> None:
        """A decode ingest given on the device, already padded by repetition
        (`_ingest_pass`'s layout: slots [P], rows [P * R], positions [P, R],
        cuts [P]); `max_position` bounds the positions from above (host).
        The batch is padded to a capture size and replays a graph."""
        pool = self.pool
        pool.reserve(0, max_position + 1)  # before the key: a reallocation voids the graphs
        num_keys = key_range(self.graphs, max_position + 1, pool.capacity)
        size, rows = padded_batch(slots.shape[0]), positions.shape[1]
        inputs = [padded(slots, size),
                  padded(target_hidden.view(slots.shape[0], rows, -1), size).flatten(0, 1),
                  padded(next_token_ids.view(-1, rows), size).flatten(),
                  padded(positions, size), padded(cuts, size)]
        ran = self.graphs is not None and self.graphs.run(
            pool.version, ("ingest", size, rows, num_keys), self._ingest_pass, inputs,
            num_keys)[0]
        if not ran:
            self._ingest_pass(*inputs, num_keys)

    def _ingest_pass(self, slots: torch.Tensor, target_hidden: torch.Tensor,
                     next_token_ids: torch.Tensor, positions: torch.Tensor,
                     cuts: torch.Tensor, num_keys: int) -> None:
        """A decode ingest on device tensors (no sync, shapes fixed by
        positions [Bp, R] and num_keys: a graph can capture it). Row r of
        request b is (target_hidden, next_token_ids)[b * R + r] at
        positions[b, r]; rows past a request's count repeat its last row, and
        padding requests repeat the last one (their writes are identical)."""
        pool, (batch, rows) = self.pool, positions.shape
        hidden = self.layer.input_hidden(target_hidden)
        q, k, v, base = self._qkv(self._embed(next_token_ids), hidden, positions.flatten())
        pool.write(slots, cuts, slots.repeat_interleave(rows), positions.flatten(), k, v)
        queries = q.view(batch, rows, -1, self.group, q.shape[-1])
        attn = self._attend_slots(queries, slots, positions, num_keys)
        out = self._finish(attn.reshape(batch * rows, -1), base).view(batch, rows, -1)
        pool.set_last(slots, out[:, -1], self._logits(out[:, -1]))

    @torch.inference_mode()
    def decode_step(self, slots: torch.Tensor, target_hidden: torch.Tensor,
                    next_token_ids: torch.Tensor, positions: torch.Tensor, cuts: torch.Tensor,
                    root_token_ids: torch.Tensor, root_positions: torch.Tensor, num_keys: int,
                    shape: tuple[int, int, int], emit: Callable) -> None:
        """A decode step in one pass: the ingest of `_ingest_pass` (its padded
        layout: slots [P], target_hidden [P * R, *], next_token_ids [P * R],
        positions [P, R], cuts [P]), then trees of `shape` (topk, num_steps,
        num_draft_tokens) from root_token_ids [P] at root_positions [P],
        handed to `emit(slots, tree)` inside the pass. `num_keys` bounds the
        positions from above (host). The inputs are the caller's persistent
        buffers: on CUDA the pass replays one graph that reads them in place."""
        inputs = [slots, target_hidden, next_token_ids, positions, cuts, root_token_ids,
                  root_positions]
        run_step_pass(self.graphs, self._step_pass, self.pool, inputs, num_keys, shape, emit)

    def _step_pass(self, slots, target_hidden, next_token_ids, positions, cuts, root_token_ids,
                   root_positions, num_keys: int, shape: tuple[int, int, int],
                   emit: Callable) -> None:
        self._ingest_pass(slots, target_hidden, next_token_ids, positions, cuts, num_keys)
        emit(slots, self._draft_pass(slots, root_token_ids, root_positions, num_keys, *shape))

    def _attend(self, queries: torch.Tensor, slots: np.ndarray,
                query_positions: list[np.ndarray]) -> torch.Tensor:
        """Causal attention of G requests' new rows (concatenated, [Tq, nh, hd];
        positions host arrays) over their slots' cached positions. Returns
        [Tq, nh, hd]."""
        device = queries.device
        q_pos = _pad_host(query_positions, NO_QUERY)  # [G, Tmax]
        rows = to_device(np.flatnonzero(q_pos >= 0), device)
        padded = queries.new_zeros(q_pos.size, *queries.shape[1:])
        padded[rows] = queries
        padded = padded.view(*q_pos.shape, -1, self.group, queries.shape[-1])
        out = self._attend_slots(padded, to_device(slots, device), to_device(q_pos, device),
                                 int(q_pos.max()) + 1)
        return out.flatten(0, 1)[rows]

    def _attend_slots(self, queries: torch.Tensor, index: torch.Tensor,
                      positions: torch.Tensor, num_keys: int) -> torch.Tensor:
        """queries [G, T, kvh, g, hd] at positions [G, T] (NO_QUERY: padding)
        over the cached keys < num_keys of slots index [G], causal. Returns
        [G, T, nh, hd]."""
        return attend_cached(queries, self.pool, index, positions, num_keys, self.scale,
                             self.attention_backend)

    def _context(self, slots: torch.Tensor, num_keys: int):
        """What a drafting pass reads of the slots' caches: keys, values
        [B, kvh, L, hd] and an additive mask [B, L] (0 where valid, -inf
        where not), made once for all of the pass's steps; for the kernel,
        only the slots: it reads the pool in place (`head_attention.py`)."""
        return draft_context(self.pool, slots, num_keys, self.attention_backend)

    def _depth_rope(self, root_positions: torch.Tensor, num_depths: int):
        """The positions [B, D] expanded at depths 1..D (root + depth - 1: a
        node's row sits at its parent's position) and their (cos, sin)
        [B, D, hd]."""
        offsets = torch.arange(num_depths, device=root_positions.device)
        positions = root_positions[:, None] + offsets
        return positions, *self.layer.rope(positions)

    def _expand(self, ctx, beam_tokens, parent_out, path_kv, position, rope):
        """Run the layer on the beam: tokens [B, k], parent outputs [B, k, H],
        ancestors' K/V [B, k, kvh, d, hd] each, this depth's position [B]
        and its rope (cos, sin) [B, hd]; returns out [B, k, H] and the path
        K/V with the beam's own appended ([B, k, kvh, d + 1, hd]). The
        request's cache ([B, kvh, L, hd], mask [B, L]: `_context`) is shared
        by its k beam nodes (never copied per node: at B=64, k=8 on an
        8B-shaped head a copy was 3 GiB)."""
        batch, width = beam_tokens.shape
        if width > 1:
            position = position[:, None].expand(-1, width).reshape(-1)
            rope = tuple(t[:, None].expand(-1, width, -1).reshape(batch * width, -1)
                         for t in rope)
        q, k, v, base = self._qkv(self._embed(beam_tokens.reshape(-1)),
                                  parent_out.reshape(batch * width, -1), position, rope)
        path_k = torch.cat([path_kv[0], k.view(batch, width, -1, 1, k.shape[-1])], 3)
        path_v = torch.cat([path_kv[1], v.view(batch, width, -1, 1, v.shape[-1])], 3)
        attn = attend_draft(ctx, self.pool, q.view(batch, width, -1, q.shape[-1]),
                            (path_k, path_v), position.view(batch, width), self.scale)
        out = self._finish(attn.reshape(batch * width, -1), base)
        return out.view(batch, width, -1), (path_k, path_v)

    @torch.inference_mode()
    def draft_trees(self, req_ids: list[str], root_token_ids: torch.Tensor,
                    root_positions: torch.Tensor, topk: int, num_steps: int,
                    num_draft_tokens: int) -> DraftTree:
        """EAGLE-2 trees of `num_draft_tokens` nodes (root = the last verified
        token at `root_positions` [B]) for requests whose cache ends at root - 1.
        With CUDA graphs the returned tensors are the graph's outputs: read
        them before the next call."""
        pool = self.pool
        slots = np.array([pool.slot_of[r] for r in req_ids], dtype=np.int64)
        num_keys = int(pool.last_positions[slots].max()) + 1
        return self.draft_slots(to_device(slots, pool.device), root_token_ids,
                                root_positions, num_keys, topk, num_steps, num_draft_tokens)

    @torch.inference_mode()
    def draft_slots(self, slots: torch.Tensor, root_token_ids: torch.Tensor,
                    root_positions: torch.Tensor, num_keys: int, topk: int, num_steps: int,
                    num_draft_tokens: int) -> DraftTree:
        """`draft_trees` for pool slots [B] on the device, reading cached
        positions < num_keys (a host upper bound: no sync)."""
        shape = (topk, num_steps, num_draft_tokens)
        if self.graphs is not None and self.tree_logits_hook is None:  # a hook runs eagerly
            return run_draft_pass(self.graphs, self._draft_pass, self.pool, slots,
                                  root_token_ids, root_positions, num_keys, shape)
        return self._draft_pass(slots, root_token_ids, root_positions,
                                min(num_keys, self.pool.capacity), *shape)

    def _draft_pass(self, slots: torch.Tensor, root_token_ids: torch.Tensor,
                    root_positions: torch.Tensor, num_keys: int, topk: int, num_steps: int,
                    num_draft_tokens: int) -> DraftTree:
        """The whole drafting pass on device tensors (slots [B] int64; keys
        read: positions < num_keys): shapes fixed by (B, num_keys, tree
        shape) and no host sync, so a CUDA graph can capture it."""
        if topk == 1 and self.tree_logits_hook is None:  # the hook reads the tree's pool
            return self._draft_chain_pass(slots, root_token_ids, root_positions, num_keys,
                                          num_draft_tokens)
        return self._draft_tree_pass(slots, root_token_ids, root_positions, num_keys, topk,
                                     num_steps, num_draft_tokens)

    def _draft_chain_pass(self, slots: torch.Tensor, root_token_ids: torch.Tensor,
                          root_positions: torch.Tensor, num_keys: int,
                          num_draft_tokens: int) -> DraftTree:
        """`_draft_pass` for chains (top-1): the argmax at each step, without
        the tree's candidate pool, sort and ancestry (what EAGLE-2's search
        reduces to at k = 1, in a fraction of the kernels)."""
        pool, layer, batch = self.pool, self.layer, slots.shape[0]
        ctx = self._context(slots, num_keys)
        tokens = [root_token_ids, layer.to_target(self._chain_logits(
            self._first_logits(pool.last_logits[slots]), slots, 0).argmax(-1))]
        parent_out = pool.last_out[slots][:, None]  # [B, 1, H]
        path_kv = (pool.keys.new_zeros(batch, 1, layer.num_kv_heads, 0, layer.head_dim),) * 2
        positions, cos, sin = self._depth_rope(root_positions, num_draft_tokens - 2)
        for d in range(num_draft_tokens - 2):  # depths 1..N-2
            parent_out, path_kv = self._expand(ctx, tokens[-1][:, None], parent_out, path_kv,
                                               positions[:, d], (cos[:, d], sin[:, d]))
            logits = self._chain_logits(self._logits(parent_out[:, 0]), slots, d + 1)
            tokens.append(layer.to_target(logits.argmax(-1)))
        return chain_tree(torch.stack(tokens, 1), root_positions)

    def _chain_logits(self, logits: torch.Tensor, slots: torch.Tensor,
                      draft_step: int) -> torch.Tensor:
        """A chain's draft-step logits [B, V_draft], shown to the hook first."""
        if self.draft_logits_hook is not None:
            self.draft_logits_hook(logits, slots, draft_step)
        return logits

    def _draft_tree_pass(self, slots: torch.Tensor, root_token_ids: torch.Tensor,
                         root_positions: torch.Tensor, num_keys: int, topk: int,
                         num_steps: int, num_draft_tokens: int) -> DraftTree:
        """`_draft_pass` for trees (EAGLE-2: expand the best k of each
        step's k * k, pool, keep the best num_draft_tokens - 1)."""
        pool, layer, batch = self.pool, self.layer, slots.shape[0]
        ctx = self._context(slots, num_keys)
        positions, cos, sin = self._depth_rope(root_positions, num_steps - 1)
        logprobs, draft_ids = self._topk(
            self._tree_logits(self._first_logits(pool.last_logits[slots]), slots), topk)  # [B, k]
        root = torch.full((batch, 1), ROOT_PARENT, dtype=torch.long, device=slots.device)
        pooled = extend_draft_pool(None, layer.to_target(draft_ids)[:, None],
                                   logprobs[:, None], root)
        beam, offset = next_beam(pooled.scores, 0, topk), pooled.scores.shape[1]
        parent_out = pool.last_out[slots][:, None].expand(batch, topk, -1)
        path_kv = (pool.keys.new_zeros(batch, topk, layer.num_kv_heads, 0, layer.head_dim),) * 2
        for depth in range(1, num_steps):
            out, path_kv = self._expand(ctx, pooled.token_ids.gather(1, beam), parent_out,
                                        path_kv, positions[:, depth - 1],
                                        (cos[:, depth - 1], sin[:, depth - 1]))
            logits = self._tree_logits(self._logits(out), slots, pooled, beam)
            logprobs, draft_ids = self._topk(logits, topk)  # [B, k, k]
            pooled = extend_draft_pool(pooled, layer.to_target(draft_ids), logprobs, beam)
            beam = next_beam(pooled.scores[:, offset:], offset, topk)
            row = (beam - offset) // topk  # which expanded node each new beam node came from
            offset = pooled.scores.shape[1]
            parent_out = out.gather(1, row[..., None].expand(-1, -1, out.shape[-1]))
            pick = row[:, :, None, None, None]
            path_kv = tuple(t.gather(1, pick.expand_as(t)) for t in path_kv)
        tree = build_draft_tree(pooled, root_token_ids, root_positions, num_draft_tokens,
                                validate=False)
        if self.rank_nodes:
            tree.score_ranks = score_ranks(pooled.scores, tree.cand_ids)
        return tree

    def _first_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.first_logits_mask is None else self.first_logits_mask(logits)

    def _tree_logits(self, logits, slots, pooled=None, beam=None) -> torch.Tensor:
        if self.tree_logits_hook is None:
            return logits
        return self.tree_logits_hook(logits, slots, pooled, beam)

    def _topk(self, logits: torch.Tensor, topk: int):
        """Top-k draft ids and their log-probs (path-score increments): one
        kernel per call on CUDA (`proposers/draft_topk.py`)."""
        return draft_topk(logits, topk, self.draft_temperature)
