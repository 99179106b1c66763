"""Inference of a one-layer drafter: ingest verified positions, draft EAGLE-2
trees. The drafter is an EAGLE-3 head (`training/eagle3_model.py`, vLLM's
`llama_eagle3.py` layout) or an MTP layer (`training/mtp_model.py`, vLLM's
`mimo_mtp`), behind `draft_layers.py`.

The runtime keeps the drafter's KV cache per request: one K/V row per
verified position t, computed from (the target's hidden state at t: EAGLE-3's
fc(aux layers), MTP's last layer; embed(token t+1)) at rope position t. Drafting (EAGLE-2, arXiv 2406.16858) starts from
the output at the last verified position: its top-k are the depth-1 nodes;
expanding a depth-d node runs the layer on (its parent's output, embed(node))
at position root + d - 1, attending to the request's cache plus the keys of
its own ancestors in the draft (tree attention), and pools the k*k children
by path log-probability; the best k are expanded next. Draft K/V rows are
never stored: after verification the accepted positions are ingested with the
target's hidden states, as vLLM's eagle3 does.

Shapes: B requests, k = topk, nh heads (after GQA repeat), hd head size,
H head hidden size, Vd draft vocabulary.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from vllm_specplug.proposers.draft_layers import as_draft_layer
from vllm_specplug.verification.metadata import ROOT_PARENT, DraftTree
from vllm_specplug.verification.tree_build import (build_draft_tree, flatten_draft_steps,
                                                   next_beam)


NO_POSITION = 1 << 62  # padding keys: after every query position, so never attended
ATTENTION_ELEMENTS = 1 << 27  # score elements per ingest group (float32: 512 MiB)


def _groups(counts: list[int], cache_lengths: list[int], num_heads: int) -> list[list[int]]:
    """Consecutive request groups whose padded score tensor stays under
    ATTENTION_ELEMENTS (a request alone may exceed it)."""
    groups, current, max_q, max_k = [], [], 0, 0
    for r, (num_q, num_k) in enumerate(zip(counts, cache_lengths)):
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


@dataclass
class RequestCache:
    keys: torch.Tensor  # [L, nh, hd] float32, roped
    values: torch.Tensor  # [L, nh, hd] float32
    positions: np.ndarray  # [L] int64, ascending; on the host (no device sync to slice)
    last_out: torch.Tensor  # [H] the layer's output at the last position
    last_logits: torch.Tensor  # [Vd] draft logits there


class HeadRuntime:
    def __init__(self, head, embed: Callable[[torch.Tensor], torch.Tensor],
                 draft_temperature: float = 1.0):
        """head: an `Eagle3Head` or a `draft_layers` drafter (MTP)."""
        self.layer = as_draft_layer(head)
        self.draft_temperature = draft_temperature
        self.embed = embed  # target token ids [T] -> [T, H] (the target's embedding)
        self.caches: dict[str, RequestCache] = {}
        self.scale = self.layer.head_dim ** -0.5

    def forget(self, req_id: str) -> None:
        self.caches.pop(req_id, None)

    def last_position(self, req_id: str) -> int:
        cache = self.caches.get(req_id)
        return -1 if cache is None else int(cache.positions[-1])

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(token_ids).to(torch.float32)

    def _qkv(self, embeds, hidden, positions):
        """[R, H] inputs at positions [R] -> q, k, v [R, nh, hd] (roped q, k)
        and the residual base [R, H]."""
        return self.layer.qkv(embeds, hidden, positions)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.layer.logits(out)

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
        are concatenated in `req_ids` order, `counts[r]` rows each ([T, *],
        [T], [T]); attention runs over each request's cache padded to a batch
        (in groups bounded by ATTENTION_ELEMENTS, so a batch of prefills fits).
        Cache bookkeeping runs on host copies of the positions: no step
        waits for the device per request."""
        hidden = self.layer.input_hidden(target_hidden)
        host_positions = positions.cpu().numpy().astype(np.int64)
        positions = positions.to(hidden.device)
        q, k, v, base = self._qkv(self._embed(next_token_ids), hidden, positions)
        starts = [0, *itertools.accumulate(counts)]
        keys, values, cached = [], [], []
        for r, req_id in enumerate(req_ids):
            rows = slice(starts[r], starts[r + 1])
            new_k, new_v, new_pos = k[rows], v[rows], host_positions[rows]
            cache = self.caches.get(req_id)
            if cache is not None:  # positions ascend: the kept rows are a prefix
                keep = int(np.searchsorted(cache.positions, new_pos[0]))
                new_k = torch.cat([cache.keys[:keep], new_k])
                new_v = torch.cat([cache.values[:keep], new_v])
                new_pos = np.concatenate([cache.positions[:keep], new_pos])
            keys.append(new_k)
            values.append(new_v)
            cached.append(new_pos)
        attn = torch.empty_like(q)
        for group in _groups(counts, [len(p) for p in cached], q.shape[1]):
            rows = slice(starts[group[0]], starts[group[-1] + 1])
            attn[rows] = self._attend(
                [q[starts[r]:starts[r + 1]] for r in group],
                [host_positions[starts[r]:starts[r + 1]] for r in group],
                [keys[r] for r in group], [values[r] for r in group],
                [cached[r] for r in group])
        out = self.layer.finish(attn.reshape(attn.shape[0], -1), base)
        last = [end - 1 for end in starts[1:]]
        logits = self._logits(out[last])
        for r, req_id in enumerate(req_ids):
            self.caches[req_id] = RequestCache(keys[r], values[r], cached[r], out[last[r]],
                                               logits[r])

    def _attend(self, queries, query_positions, keys, values, key_positions) -> torch.Tensor:
        """Causal attention of each request's new rows ([Tq_i, nh, hd]) over its
        cache ([Lk_i, nh, hd]), padded to one batch; positions are host
        arrays. Returns the rows concatenated ([sum Tq_i, nh, hd])."""
        pad = torch.nn.utils.rnn.pad_sequence
        device = queries[0].device
        q_pos = _pad_host(query_positions, -1)  # [G, Tq]
        k_pos = _pad_host(key_positions, NO_POSITION)  # [G, Lk]
        allowed = torch.from_numpy(k_pos[:, None, :] <= q_pos[:, :, None]).to(device)
        scores = torch.einsum("gthd,glhd->ghtl", pad(queries, batch_first=True),
                              pad(keys, batch_first=True))
        scores = (scores * self.scale).masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("ghtl,glhd->gthd", scores.softmax(-1), pad(values, batch_first=True))
        rows = torch.from_numpy(np.flatnonzero(q_pos >= 0)).to(device)
        return out.flatten(0, 1)[rows]

    def _context(self, req_ids: list[str]):
        """Padded caches: keys, values [B, nh, Lmax, hd], valid [B, Lmax]."""
        caches = [self.caches[r] for r in req_ids]
        keys = torch.nn.utils.rnn.pad_sequence([c.keys for c in caches], batch_first=True)
        values = torch.nn.utils.rnn.pad_sequence([c.values for c in caches],
                                                 batch_first=True)
        lengths = torch.tensor([c.keys.shape[0] for c in caches], device=keys.device)
        valid = torch.arange(keys.shape[1], device=keys.device)[None, :] < lengths[:, None]
        return keys.transpose(1, 2), values.transpose(1, 2), valid

    def _expand(self, ctx, beam_tokens, parent_out, path_kv, position):
        """Run the layer on the beam: tokens [B, k], parent outputs [B, k, H],
        ancestors' K/V [B, k, nh, d, hd] each; returns out [B, k, H] and the
        beam's own K/V [B, k, nh, hd]. The request's cache is shared by its k
        beam nodes (never copied per node: at B=64, k=8 on an 8B-shaped head a
        copy was 3 GiB)."""
        keys_ctx, values_ctx, valid = ctx  # [B, nh, L, hd] x2, [B, L]
        batch, width = beam_tokens.shape
        positions = position.repeat_interleave(width)
        q, k, v, base = self._qkv(self._embed(beam_tokens.reshape(-1)),
                                  parent_out.reshape(batch * width, -1), positions)
        path_k = torch.cat([path_kv[0], k.view(batch, width, -1, 1, k.shape[-1])], 3)
        path_v = torch.cat([path_kv[1], v.view(batch, width, -1, 1, v.shape[-1])], 3)
        q = q.view(batch, width, *q.shape[1:])  # [B, k, nh, hd]
        ctx_scores = torch.einsum("bwhd,bhld->bwhl", q, keys_ctx)
        ctx_scores = ctx_scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        scores = torch.cat([ctx_scores, torch.einsum("bwhd,bwhld->bwhl", q, path_k)], -1)
        probs = (scores * self.scale).softmax(-1)
        num_ctx = keys_ctx.shape[2]
        attn = (torch.einsum("bwhl,bhld->bwhd", probs[..., :num_ctx], values_ctx)
                + torch.einsum("bwhl,bwhld->bwhd", probs[..., num_ctx:], path_v))
        out = self.layer.finish(attn.reshape(batch * width, -1), base)
        return out.view(batch, width, -1), (path_k, path_v)

    @torch.inference_mode()
    def draft_trees(self, req_ids: list[str], root_token_ids: torch.Tensor,
                    root_positions: torch.Tensor, topk: int, num_steps: int,
                    num_draft_tokens: int) -> DraftTree:
        """EAGLE-2 trees of `num_draft_tokens` nodes (root = the last verified
        token at `root_positions`) for requests whose cache ends at root - 1."""
        layer, batch = self.layer, len(req_ids)
        ctx = self._context(req_ids)
        last_out = torch.stack([self.caches[r].last_out for r in req_ids])
        logprobs, draft_ids = self._topk(torch.stack(
            [self.caches[r].last_logits for r in req_ids]), topk)  # [B, k]
        tokens, scores = [layer.to_target(draft_ids)[:, None]], [logprobs[:, None]]
        device = last_out.device
        beams = [torch.full((batch, 1), ROOT_PARENT, dtype=torch.long, device=device)]
        pooled = flatten_draft_steps(tokens, scores, beams)
        beam, offset = next_beam(pooled.scores, 0, topk), pooled.scores.shape[1]
        parent_out = last_out[:, None].expand(batch, topk, -1)
        nh, hd = layer.num_heads, layer.head_dim
        path_kv = (torch.zeros(batch, topk, nh, 0, hd, device=device),) * 2
        for depth in range(1, num_steps):
            out, path_kv = self._expand(ctx, pooled.token_ids.gather(1, beam), parent_out,
                                        path_kv, root_positions + depth - 1)
            logprobs, draft_ids = self._topk(self._logits(out), topk)  # [B, k, k]
            tokens.append(layer.to_target(draft_ids))
            scores.append(logprobs)
            beams.append(beam)
            pooled = flatten_draft_steps(tokens, scores, beams)
            beam = next_beam(pooled.scores[:, offset:], offset, topk)
            row = (beam - offset) // topk  # which expanded node each new beam node came from
            offset = pooled.scores.shape[1]
            parent_out = out.gather(1, row[..., None].expand(-1, -1, out.shape[-1]))
            pick = row[:, :, None, None, None]
            path_kv = tuple(t.gather(1, pick.expand_as(t)) for t in path_kv)
        return build_draft_tree(pooled, root_token_ids, root_positions, num_draft_tokens,
                                validate=False)

    def _topk(self, logits: torch.Tensor, topk: int):
        """Top-k draft ids and their log-probs (path-score increments)."""
        return F.log_softmax(logits.float() / self.draft_temperature, dim=-1).topk(topk, dim=-1)
