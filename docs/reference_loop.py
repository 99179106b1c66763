"""The speculative decoding loop, written with the reference functions.

This is the specification: tests run it with backend="torch" and "triton" and
require (1) output identical to plain greedy decoding of the target and (2)
kernels identical to references. The toy models use integer-valued float64
weights so that every sum is exact and argmax ties break identically.
Target: logits(t) = (sum over positions s <= t of E[x_s] * W[s % P]) @ U, i.e.
each position's "KV" row is E[x_s] * W[s % P], kept in a paged cache.
Draft: a bigram model, log_softmax(D[x_t]).
"""
import torch

from vllm_specplug.verification.kv_compaction import compact_kv_cache
from vllm_specplug.verification.tree_build import build_draft_tree, flatten_draft_steps, next_beam
from vllm_specplug.verification.tree_greedy import verify_tree_greedy


def slots(block_table, positions, block_size):  # vLLM's paged layout
    return block_table.gather(1, positions // block_size) * block_size + positions % block_size


def draft_candidates(D, roots, topk, depth):  # EAGLE-2: expand the best k nodes per step
    tokens, logprobs, beams, offset = [], [], [torch.full_like(roots[:, None], -1)], 0
    last = roots[:, None]
    for step in range(depth):
        lp, tok = D[last].log_softmax(-1).topk(topk, dim=-1)  # [B, rows, k]
        tokens.append(tok); logprobs.append(lp.float())
        pooled = flatten_draft_steps(tokens, logprobs, beams)
        beams.append(next_beam(pooled.scores[:, offset:], offset, topk))
        offset = pooled.scores.shape[1]
        last = pooled.token_ids.gather(1, beams[-1])
    return pooled


def speculative_greedy(model, D, prompts, num_steps, topk, depth, num_draft_tokens,
                       block_size=4, backend="torch"):
    E, W, U = model
    batch, prompt_len = prompts.shape
    max_len = prompt_len + num_steps * num_draft_tokens + num_draft_tokens
    blocks = -(-max_len // block_size)
    block_table = torch.randperm(batch * blocks).view(batch, blocks)
    cache = torch.zeros(1, batch * blocks, block_size, 1, E.shape[1], dtype=E.dtype)
    flat = cache.view(-1, E.shape[1])
    positions = torch.arange(prompt_len - 1).expand(batch, -1)
    flat[slots(block_table, positions, block_size)] = E[prompts[:, :-1]] * W[positions % len(W)]
    seq_lens, roots, out = torch.full((batch,), prompt_len - 1), prompts[:, -1], [[] for _ in range(batch)]
    for _ in range(num_steps):
        cands = draft_candidates(D, roots, topk, depth)
        tree = build_draft_tree(cands, roots, seq_lens, num_draft_tokens, backend=backend)
        node_pos = seq_lens[:, None] + torch.arange(num_draft_tokens)  # nodes written in order
        flat[slots(block_table, node_pos, block_size)] = E[tree.token_ids] * W[tree.positions % len(W)]
        prefix = torch.stack([flat[slots(block_table[b:b + 1], torch.arange(seq_lens[b])[None], block_size)[0]].sum(0)
                              for b in range(batch)])
        node_kv = flat[slots(block_table, node_pos, block_size)]
        hidden = prefix[:, None] + tree.attn_mask.to(E.dtype) @ node_kv  # tree attention
        verified = verify_tree_greedy(tree, (hidden @ U).argmax(-1), backend=backend)
        compact_kv_cache(cache, block_table, seq_lens, verified.accepted_node_ids,
                         verified.num_accepted, backend=backend)
        for b in range(batch):
            out[b] += verified.output_token_ids[b, :verified.num_accepted[b] + 1].tolist()
        roots = verified.output_token_ids.gather(1, verified.num_accepted[:, None])[:, 0]
        seq_lens = seq_lens + verified.num_accepted + 1
    return out


def plain_greedy(model, prompts, num_new):
    E, W, U = model
    seqs = prompts.clone()
    for _ in range(num_new):
        kv = E[seqs] * W[torch.arange(seqs.shape[1]) % len(W)]
        seqs = torch.cat([seqs, (kv.sum(1) @ U).argmax(-1, keepdim=True)], 1)
    return seqs[:, prompts.shape[1]:].tolist()
