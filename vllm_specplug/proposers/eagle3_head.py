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

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from vllm_specplug.proposers.draft_layers import as_draft_layer
from vllm_specplug.verification.metadata import ROOT_PARENT, DraftTree
from vllm_specplug.verification.tree_build import (build_draft_tree, flatten_draft_steps,
                                                   next_beam)


@dataclass
class RequestCache:
    keys: torch.Tensor  # [L, nh, hd] float32, roped
    values: torch.Tensor  # [L, nh, hd] float32
    positions: torch.Tensor  # [L] int64, ascending
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

    def _layer(self, q, keys, values, allowed, base) -> torch.Tensor:
        """q [R, nh, hd] against keys/values [R, nh, Lk, hd] where `allowed`
        [R, Lk]; returns the layer output [R, H] (the next hidden)."""
        scores = torch.einsum("rhd,rhld->rhl", q, keys) * self.scale
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        attn = torch.einsum("rhl,rhld->rhd", scores.softmax(-1), values)
        return self.layer.finish(attn.reshape(attn.shape[0], -1), base)

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
        hidden = self.layer.input_hidden(target_hidden)
        q, k, v, base = self._qkv(self._embed(next_token_ids), hidden, positions)
        cache = self.caches.get(req_id)
        if cache is not None:
            keep = cache.positions < positions[0]
            k = torch.cat([cache.keys[keep], k])
            v = torch.cat([cache.values[keep], v])
            positions = torch.cat([cache.positions[keep], positions])
        num_new = q.shape[0]
        query_pos = positions[-num_new:]
        allowed = positions[None, :] <= query_pos[:, None]  # causal over cache + new
        keys = k.transpose(0, 1)[None].expand(num_new, -1, -1, -1)
        values = v.transpose(0, 1)[None].expand(num_new, -1, -1, -1)
        out = self._layer(q, keys, values, allowed, base)
        self.caches[req_id] = RequestCache(k, v, positions, out[-1], self._logits(out[-1]))

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
        beam's own K/V [B, k, nh, hd]."""
        keys_ctx, values_ctx, valid = ctx
        batch, width = beam_tokens.shape
        rows = batch * width
        positions = position.repeat_interleave(width)
        q, k, v, base = self._qkv(self._embed(beam_tokens.reshape(-1)),
                                  parent_out.reshape(rows, -1), positions)
        path_k = torch.cat([path_kv[0], k.view(batch, width, -1, 1, k.shape[-1])], 3)
        path_v = torch.cat([path_kv[1], v.view(batch, width, -1, 1, v.shape[-1])], 3)
        keys = torch.cat([keys_ctx.repeat_interleave(width, 0),
                          path_k.reshape(rows, *path_k.shape[2:])], 2)
        values = torch.cat([values_ctx.repeat_interleave(width, 0),
                            path_v.reshape(rows, *path_v.shape[2:])], 2)
        allowed = torch.cat([valid.repeat_interleave(width, 0),
                             torch.ones(rows, path_k.shape[3], dtype=torch.bool,
                                        device=valid.device)], 1)
        out = self._layer(q, keys, values, allowed, base)
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
