"""Prompt-lookup drafts in place of a head's chain where the history repeats.

A head drafts what its training text made likely; a request that has fallen
into a loop (a small model's greedy output repeating a sentence, a digit
string, a list's pattern) or copies its prompt is drafted better by looking
the continuation up in its own history (prompt lookup decoding, Saxena
2023; vLLM's `ngram`). On SmolLM2 at batch 64 (H100, MT-Bench, bf16) one
request of 64 decoding a digit string for 124 steps at one token a step made
our chain's whole wave (docs/results/smollm2_request_steps_h100_s73); on CPU
(float32, MT-Bench) lookups with N = 3 took SmolLM2's chain from 1.43 to
1.98 tokens a verify step, every output exact
(docs/results/smollm2_chain_lookup_cpu).

`prompt_lookup_min` > 0 turns it on: each step, a request whose last n
tokens (prompt_lookup_min <= n <= prompt_lookup_max) occurred earlier with
K tokens after them (K: the drafting steps, a chain's length or a tree's
depth) looks those K tokens up (`ngram.longest_matches`' choice). A chain
takes them in place of the head's; a tree keeps the head's nodes and takes
the lookup as one more branch (`graft_lookups`: the part of the lookup the
tree already drafts is followed, the rest replaces the tree's last nodes,
those EAGLE-2 ranked lowest). The head ingests and drafts as before, so its
state never depends on which drafts were verified. Selection only:
verification is the target's, so lossless either way. Under a grammar a
chain whose drafts the grammar masked keeps them (they know the grammar, a
lookup may not, and the scheduler keeps a chain's valid prefix only); a
tree takes the lookup's branch there too: every node is checked against
its own path's grammar state before verification (grammar-aware trees),
so an invalid branch costs its nodes alone (SmolLM2, MT-Bench's object
questions under their schema, CPU: tree 16 1.73 → 2.30 tokens a verify
step, every output exact, docs/results/smollm2_schema_tree_lookup_cpu).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_specplug.proposers.base import DeviceProposeBatch, require
from vllm_specplug.proposers.ngram import longest_matches
from vllm_specplug.verification.metadata import MASK_WORD_BITS


def check_lookup_options(options, name: str) -> None:
    """`prompt_lookup_min` / `prompt_lookup_max` of a tree drafter's options."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    require(whole(options.prompt_lookup_min) and options.prompt_lookup_min >= 0, name,
            f"prompt_lookup_min={options.prompt_lookup_min!r} must be 0 (off) or an "
            "integer >= 1")
    if options.prompt_lookup_min == 0:
        require(options.prompt_lookup_tokens == 0, name,
                f"prompt_lookup_tokens={options.prompt_lookup_tokens!r} needs prompt lookups: "
                "set prompt_lookup_min >= 1 too, or drop it")
        return
    require(whole(options.prompt_lookup_max)
            and options.prompt_lookup_max >= options.prompt_lookup_min, name,
            f"prompt_lookup_max={options.prompt_lookup_max} must be >= "
            f"prompt_lookup_min={options.prompt_lookup_min}")
    _check_lookup_tokens(options, name)


def _check_lookup_tokens(options, name: str) -> None:
    """`prompt_lookup_tokens`: 0 (the depth) or up to the tree's draft nodes;
    a chain's lookup replaces its num_steps drafts, so it is num_steps."""
    tokens = options.prompt_lookup_tokens
    require(isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0, name,
            f"prompt_lookup_tokens={tokens!r} must be 0 (the tree's depth, num_steps) or an "
            "integer >= 1")
    if tokens == 0 or options.num_steps is None:
        return
    require(options.topk > 1 or tokens == options.num_steps, name,
            f"prompt_lookup_tokens={tokens} must equal num_steps={options.num_steps} for a "
            "chain (topk=1: a lookup replaces its drafts); leave it out")
    most = (options.num_draft_tokens or 1 + options.num_steps) - 1
    require(tokens <= most, name,
            f"prompt_lookup_tokens={tokens} must be at most num_draft_tokens - 1 = {most} "
            "(a lookup's branch takes the tree's last nodes): lower it or raise "
            "num_draft_tokens")


def lookup_chains(token_ids: np.ndarray, num_tokens: np.ndarray, n_min: int, n_max: int,
                  k: int) -> tuple[np.ndarray, np.ndarray]:
    """Host lookups. `token_ids` [B, W]: each row's history, valid up to
    `num_tokens` [B]. Returns (drafts [B, k] int64, lengths [B] int64): the
    tokens that followed the chosen occurrence of a recurring n-gram, at
    most k (0: none recurs; a chain takes only k, a tree any)."""
    num_tokens = num_tokens.astype(np.int64)
    best_n, best_end = longest_matches(token_ids, num_tokens, n_min, n_max, k)
    lengths = np.where(best_n > 0, np.clip(num_tokens - 1 - best_end, 0, k), 0)
    starts = np.where(lengths > 0, best_end + 1, 0)
    columns = starts[:, None] + np.arange(k)[None, :]
    drafts = np.take_along_axis(token_ids, np.minimum(columns, token_ids.shape[1] - 1), axis=1)
    return drafts.astype(np.int64), lengths.astype(np.int64)


class DeviceLookup:
    """Lookups on the device for Model Runner V2 (`NgramDeviceDrafter`'s
    kernels, no host sync), merged into the head's chains or grafted onto
    its trees in place."""

    def __init__(self, n_min: int, n_max: int, max_num_reqs: int, max_model_len: int,
                 k: int, device: torch.device, kernels: bool | None = None) -> None:
        from vllm_specplug.proposers.ngram_device import NgramDeviceDrafter

        self.k = k
        # the Triton kernels (None: on CUDA); else the host reference, for
        # Model Runner V2's host-side steps driven on CPU (tests)
        self.kernels = device.type == "cuda" if kernels is None else kernels
        self.drafter = NgramDeviceDrafter(n_min, n_max, max_num_reqs, max_model_len, device)
        self.drafts = torch.zeros(max_num_reqs, k, dtype=torch.int64, device=device)  # [S, K]
        self.num_draft = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # [S]
        # [2] int64: requests whose drafts took a lookup, and the nodes it
        # drafted, summed (the graft kernel adds to it by atomics)
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)

    def find(self, req_ids: list[str], token_ids: torch.Tensor, idx_mapping: torch.Tensor,
             num_tokens: torch.Tensor, num_sampled: torch.Tensor,
             num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lookups [num_reqs, K] int64, lengths [num_reqs] int64: the tokens
        found, at most K) of the batch's requests (`token_ids` [slots,
        max_len] the histories, valid up to `num_tokens` [slots];
        `num_sampled` [num_reqs]: a prefill chunk that sampled nothing takes
        no lookup)."""
        drafts, num_draft = self.drafts[:num_reqs], self.num_draft[:num_reqs]
        slots = idx_mapping[:num_reqs]
        if self.kernels:
            batch = DeviceProposeBatch(req_ids, token_ids, slots, num_tokens,
                                       num_sampled[:num_reqs])
            self.drafter.propose(batch, drafts, num_draft)
            lengths = num_draft.long()
        else:
            rows, lengths = lookup_chains(token_ids[slots].cpu().numpy(),
                                          num_tokens[slots].cpu().numpy(),
                                          self.drafter.n_min, self.drafter.n_max, self.k)
            drafts.copy_(torch.from_numpy(rows))
            lengths = torch.from_numpy(lengths).to(drafts.device)
        return drafts, torch.where(num_sampled[:num_reqs] > 0, lengths, 0)

    def merge(self, req_ids: list[str], token_ids: torch.Tensor, idx_mapping: torch.Tensor,
              num_tokens: torch.Tensor, num_sampled: torch.Tensor,
              chains: torch.Tensor) -> None:
        """`chains` [num_reqs, K] int64: the head's drafts, replaced where a
        lookup finds K tokens (`find`'s arguments)."""
        drafts, lengths = self.find(req_ids, token_ids, idx_mapping, num_tokens, num_sampled,
                                    chains.shape[0])
        found = lengths == self.k  # a chain takes a whole lookup only
        torch.where(found[:, None], drafts, chains, out=chains)
        self.counts += torch.stack([found.sum(), found.sum() * chains.shape[1]])

    def stats(self) -> dict[str, int]:
        """The counters (host syncs: for benchmarks and tests, not steps)."""
        num_rows, num_nodes = self.counts.tolist()
        return {"lookup_rows": num_rows, "lookup_nodes": num_nodes}

    def graft(self, req_ids: list[str], token_ids: torch.Tensor, idx_mapping: torch.Tensor,
              num_tokens: torch.Tensor, num_sampled: torch.Tensor, drafts: torch.Tensor,
              trees, num_nodes: int) -> None:
        """`drafts` [num_reqs, >= num_nodes - 1] int64: the trees' nodes past
        the root, just drafted and stored in `trees` (TreeSlots: parents,
        depths, packed masks, node ranks per state slot); each found lookup
        becomes a branch of its request's tree (`graft_lookups`), in both."""
        num_reqs = drafts.shape[0]
        if self.kernels:  # the n-gram kernels, then one launch for every row's graft
            self._graft_kernel(req_ids, token_ids, idx_mapping, num_tokens, num_sampled,
                               drafts, trees, num_nodes)
            return
        looked_up, lengths = self.find(req_ids, token_ids, idx_mapping, num_tokens,
                                       num_sampled, num_reqs)
        slots = idx_mapping[:num_reqs]
        nodes = torch.nn.functional.pad(drafts[:, :num_nodes - 1], (1, 0))  # root: unread
        parents, depths = trees.parents[slots, :num_nodes], trees.depths[slots, :num_nodes]
        bits = trees.bits[slots, :num_nodes]
        num_graft = graft_lookups(nodes, parents, looked_up, lengths, depths=depths, bits=bits)
        self.counts += torch.stack([(lengths > 0).sum(), num_graft.sum()])
        drafts[:, :num_nodes - 1] = nodes[:, 1:]
        trees.parents[:, :num_nodes].index_copy_(0, slots, parents)
        trees.depths[:, :num_nodes].index_copy_(0, slots, depths)
        trees.bits[:, :num_nodes].index_copy_(0, slots, bits)
        if trees.ranks is not None:  # a grafted node: only the whole tree has it
            node = torch.arange(num_nodes, device=drafts.device)
            grafted = node[None, :] >= num_nodes - num_graft[:, None]
            ranks = torch.where(grafted, num_nodes - 2, trees.ranks[slots, :num_nodes])
            trees.ranks[:, :num_nodes].index_copy_(0, slots, ranks)


    def warm_up(self, token_ids: torch.Tensor, num_tokens: torch.Tensor, drafts: torch.Tensor,
                trees, sizes: tuple[int, ...]) -> int:
        """Launch the kernels once at start-up (the speculator's `capture`),
        so that no step in service stalls on their compiles: on the step's
        own buffers (`token_ids`, `num_tokens`, `drafts` and the stored
        `trees`, None for chains), for each tree size in `sizes`, with a
        request that sampled nothing, which finds no lookup: nothing of theirs
        is written. Returns the launches (0 off CUDA)."""
        if not self.kernels:
            return 0
        device = drafts.device
        slots = torch.zeros(1, dtype=torch.int64, device=device)
        none = torch.zeros(1, dtype=torch.int32, device=device)
        if trees is None:
            self.merge([""], token_ids, slots, num_tokens, none, drafts[:1].clone())
            return 2
        for num_nodes in sizes:
            self._graft_kernel([""], token_ids, slots, num_tokens, none, drafts[:1], trees,
                               num_nodes)
        return 3 * len(sizes)

    def _graft_kernel(self, req_ids, token_ids, idx_mapping, num_tokens, num_sampled,
                      drafts, trees, num_nodes: int) -> None:
        """`graft` in three launches: the n-gram scan and finalize, then
        `lookup_graft_kernel` (kernels/lookup_graft.py) over the stored trees,
        counting as it goes (`graft_lookups` is its reference)."""
        from vllm_specplug.kernels.lookup_graft import lookup_graft_kernel
        from vllm_specplug.verification.backend import next_power_of_2

        num_reqs = drafts.shape[0]
        looked_up, num_lookup = self.drafts[:num_reqs], self.num_draft[:num_reqs]
        slots = idx_mapping[:num_reqs]
        self.drafter.propose(DeviceProposeBatch(req_ids, token_ids, slots, num_tokens,
                                                num_sampled[:num_reqs]), looked_up, num_lookup)
        width, words = trees.parents.shape[1], trees.bits.shape[2]
        ranks = trees.ranks if trees.ranks is not None else trees.parents
        lookup_graft_kernel[(num_reqs,)](
            drafts, drafts.stride(0), looked_up, num_lookup, slots, trees.parents,
            trees.depths, trees.bits, ranks, self.counts, num_nodes,
            N=width, W=words, L=self.k, BLOCK_N=next_power_of_2(width),
            BLOCK_W=next_power_of_2(words), HAS_RANKS=trees.ranks is not None, num_warps=1)


def graft_lookups(token_ids: torch.Tensor, parent_ids: torch.Tensor, lookups: torch.Tensor,
                  lengths: torch.Tensor, num_nodes: torch.Tensor | None = None,
                  depths: torch.Tensor | None = None,
                  bits: torch.Tensor | None = None) -> torch.Tensor:
    """Each found row's lookup as a branch of its draft tree, in place, on
    the device without a host sync.

    `token_ids` / `parent_ids` [B, N] int64: the trees (node 0 the root,
    parents before children), each row's first `num_nodes` [B] nodes real
    (None: all N); `lookups` [B, L] int64 and `lengths` [B] int64, the
    tokens each row's lookup found (0: none; `lookup_chains`), partial ones
    included (a tree takes what there is). The longest prefix of a row's lookup that its tree
    drafts among the nodes its graft keeps is followed; the remaining
    g tokens become a chain under the node it ends at, in the row's last g
    nodes. Parents come before children, so the last nodes are closed under
    descent: no kept node loses its parent. A chain's whole lookup (its
    length L, the caller's to check) replaces its nodes. `depths` [B, N]
    int32 and `bits` [B, N, W] int32 (the packed ancestor masks,
    tree_build.pack_mask), when given, are the same trees' and updated too. Returns the nodes grafted per row, [B] int64."""
    batch, width = token_ids.shape
    device = token_ids.device
    rows = torch.arange(batch, device=device)
    if num_nodes is None:
        num_nodes = torch.full((batch,), width, dtype=torch.int64, device=device)
    found = lengths > 0
    span = torch.minimum(num_nodes - 1, lengths)  # [B] lookup tokens used
    anchor, matched = _follow_tree(token_ids, parent_ids, lookups, found, num_nodes, span)
    num_graft = torch.where(found, span - matched, 0)
    first = num_nodes - num_graft  # [B] the first grafted node
    for j in range(lookups.shape[1]):
        is_graft = j < num_graft
        node = torch.where(is_graft, first + j, 0)  # unchanged rows rewrite the root
        parent = torch.where(is_graft, anchor if j == 0 else node - 1,
                             parent_ids[rows, node])
        token = lookups[rows, (matched + j).clamp(max=lookups.shape[1] - 1)]
        token_ids[rows, node] = torch.where(is_graft, token, token_ids[rows, node])
        parent_ids[rows, node] = parent
        if depths is not None:
            depths[rows, node] = torch.where(is_graft, depths[rows, parent] + 1,
                                             depths[rows, node])
        if bits is not None:
            own = _node_bits(node, bits.shape[2])
            bits[rows, node] = torch.where(is_graft[:, None], bits[rows, parent] | own,
                                           bits[rows, node])
    return num_graft


def _follow_tree(token_ids: torch.Tensor, parent_ids: torch.Tensor, lookups: torch.Tensor,
                 found: torch.Tensor, num_nodes: torch.Tensor, span: torch.Tensor):
    """(anchor [B], matched [B]): the node where the longest prefix (at most
    `span` [B] tokens) of each row's lookup ends among the nodes its graft
    keeps (the root: 0), and that prefix's length."""
    batch, width = token_ids.shape
    node = torch.arange(width, device=token_ids.device)
    anchor = torch.zeros(batch, dtype=torch.int64, device=token_ids.device)
    matched = torch.zeros_like(anchor)
    going = found.clone()
    for depth in range(lookups.shape[1]):
        # a match here leaves at most span - depth - 1 tokens to graft, so
        # nodes below num_kept + depth + 1 stay
        going &= depth < span
        kept = (node >= 1) & (node < (num_nodes - span + depth + 1)[:, None])  # [B, N]
        hit = (kept & going[:, None] & (parent_ids == anchor[:, None])
               & (token_ids == lookups[:, depth, None]))
        going &= hit.any(1)
        anchor = torch.where(going, hit.int().argmax(1), anchor)
        matched += going
    return anchor, matched


def _node_bits(node: torch.Tensor, num_words: int) -> torch.Tensor:
    """[B, W] int32: the packed mask bit of each row's `node` [B] alone (bit
    31 wraps into the sign, as pack_mask's)."""
    word = torch.arange(num_words, device=node.device)
    bit = torch.ones_like(node) << (node % MASK_WORD_BITS)
    bit = torch.where(bit >= 2 ** 31, bit - 2 ** 32, bit)
    return torch.where(word[None, :] == (node // MASK_WORD_BITS)[:, None], bit[:, None],
                       0).to(torch.int32)
