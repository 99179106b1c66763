"""Greedy tree verification under a grammar, decided on the host from the
target's unmasked choices: each node's bitmask only where it can matter.

vLLM masks every verified position's logits with its grammar row before it
samples, so under structured output a tree of N nodes costs N bitmask fills
a request and step (our worker walks, integration/worker_rows.py: 6.6 ms a
step for 64 trees of 16 nodes on the H200's host, against 4.4 ms of GPU
work, docs/results/v2_schema_tree_rows_h200). Greedy verification needs far
less. At a node whose state allows the target's unmasked argmax `a`, the
masked argmax is `a` itself: masking only removes tokens, and no smaller
index shares `a`'s logit (`a` is the *first* maximum, as `torch.argmax`
returns it). So the walk down the accepted path asks the grammar one token
per node; only where `a` is forbidden does it need the node's next choice,
taken from the node's top-k when one of them is allowed and strictly above
the k-th logit (no token outside the top-k can then reach it), else from the
node's full row and logits. Nodes off the accepted path need nothing. (The
same idea as llama.cpp's sampler, which samples first and applies the
grammar only when the sample is rejected; DOMINO, Beurer-Kellner et al.,
ICML 2024, discuss masks computed only where they change the choice.)

Stochastic verification needs each node's masked distribution, hence every
row: it stays with the rows.

The grammar is vLLM's `StructuredOutputGrammar` (xgrammar, llguidance) of
the request, advanced to its output before this step: `validate_tokens`,
`accept_tokens`, `rollback`, `fill_bitmask`, `is_terminated`. Rows follow
vLLM's: a terminated grammar allows every token.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class NodeChoices:
    """The target's unmasked choices at each node of one request's tree, on
    the host (node 0: the root, the position after the last output token)."""
    argmax_ids: np.ndarray  # [num_nodes] int64: each node's first maximal logit
    top_ids: np.ndarray     # [num_nodes, k] int64: the k largest logits' tokens, descending
    top_logits: np.ndarray  # [num_nodes, k] float32: those logits


@dataclass
class GrammarPath:
    """One request's greedy verification: what the target emits."""
    accepted_node_ids: list[int]  # the root, then each accepted node
    output_token_ids: list[int]   # the accepted drafts, then the bonus token
    num_top_choices: int = 0      # nodes decided from their top-k (the argmax forbidden)
    full_row_node_ids: list[int] = field(default_factory=list)  # decided from their full row
    # a child whose token the grammar allowed but then did not take (a
    # backend's fault): the path ends at its parent, and the child must not
    # be accepted by whoever walks the draws
    cut_node_ids: list[int] = field(default_factory=list)
    # `run(keep=True)`: the grammar's advances by the emitted tokens, kept
    # (tokens after its end take none); None: it ended where it began
    num_grammar_advances: int | None = None


def children_by_token(token_ids: Sequence[int],
                      parents: Sequence[int]) -> dict[tuple[int, int], int]:
    """{(node, draft token): child node}; siblings' tokens are distinct (the
    first such child wins otherwise, as `verify_tree_greedy_reference`'s
    walk over siblings: the nodes go in last to first). One dict built in
    C: a list of a dict a node cost 7 µs a tree of 16 in Python."""
    last = len(parents) - 1
    return dict(zip(zip(parents[last:0:-1], token_ids[last:0:-1]), range(last, 0, -1)))


class GreedyGrammarWalk:
    """The accepted path of one request's tree under its grammar (`run`).
    `full_row(node)` returns that node's logits, [vocab_size] float32, for
    the rare node decided from its full row (a copy from the device)."""

    def __init__(self, grammar, vocab_size: int, choices: NodeChoices,
                 full_row: Callable[[int], np.ndarray], request_id: str = "") -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.choices = choices
        self.full_row = full_row
        self.request_id = request_id
        self.take = xgrammar_take(grammar)  # None: tried, then taken, by two calls
        self.taken = False  # the node's choice taken by `take` already (the argmax's)

    def run(self, token_ids: Sequence[int], parents: Sequence[int],
            keep: bool = False) -> GrammarPath:
        """Follow the child drafted with the masked argmax from the root; the
        masked argmax where none was drafted is the bonus token. The grammar
        is advanced along the path and rolled back: it ends where it began;
        with `keep`, a path without cut nodes leaves it advanced by every
        emitted token, the bonus included (`num_grammar_advances`): the
        advances the request's next drafting pass would make again."""
        children = children_by_token(token_ids, parents)
        path = GrammarPath([0], [])
        num_accepted = 0
        try:
            node = 0
            while True:
                token = self._choice(node, path)
                path.output_token_ids.append(token)
                child = children.get((node, token))
                taken, self.taken = self.taken, False
                num_accepted += taken
                if child is None:
                    if keep:
                        num_accepted = self._keep_bonus(token, num_accepted, path, taken)
                    return path
                # vLLM ignores tokens after the end
                if not taken and not self.grammar.is_terminated():
                    if not self.grammar.accept_tokens(self.request_id, [token]):
                        # allowed, yet not taken (vLLM logs it): `token` is still the
                        # masked choice here, so the path ends with it, exact
                        path.cut_node_ids.append(child)
                        return path
                    num_accepted += 1
                path.accepted_node_ids.append(child)
                node = child
        finally:
            if path.num_grammar_advances is None:
                self.grammar.rollback(num_accepted)

    def _keep_bonus(self, token: int, num_accepted: int, path: GrammarPath,
                    taken: bool) -> int:
        """The bonus token accepted too (`taken`: already), where the grammar
        has not ended, and the path's advances kept
        (`path.num_grammar_advances`); where the grammar refuses it (a
        backend's fault: it was allowed) nothing is kept. Returns the
        advances made."""
        if not taken and not self.grammar.is_terminated():
            if not self.grammar.accept_tokens(self.request_id, [token]):
                return num_accepted
            num_accepted += 1
        path.num_grammar_advances = num_accepted
        return num_accepted

    def _allowed(self, token: int) -> bool:
        if self.grammar.is_terminated():
            return True
        return 0 <= token < self.vocab_size and bool(self.grammar.validate_tokens([token]))

    def _allowed_or_taken(self, token: int) -> bool:
        """`_allowed`, where xgrammar's matcher can try a token: taken too
        when allowed (`self.taken`), in one call."""
        if self.take is None or self.grammar.is_terminated():
            return self._allowed(token)
        self.taken = 0 <= token < self.vocab_size and self.take(token)
        return self.taken

    def _choice(self, node: int, path: GrammarPath) -> int:
        """The masked argmax at `node`, the grammar in that node's state
        (`self.taken`: the grammar took it already)."""
        argmax = int(self.choices.argmax_ids[node])
        if self._allowed_or_taken(argmax):
            return argmax
        token = self._top_choice(node)
        if token is not None:
            path.num_top_choices += 1
            return token
        path.full_row_node_ids.append(node)
        return self._full_row_choice(node)

    def _top_choice(self, node: int) -> int | None:
        """The smallest allowed token of the largest logit in the top-k that
        has one, if that logit is strictly above the k-th (else a token
        outside the top-k may tie it: None)."""
        ids, logits = self.choices.top_ids[node], self.choices.top_logits[node]
        if np.isnan(logits).any():
            return None
        best = None
        for token, logit in zip(ids.tolist(), logits.tolist()):
            if best is not None and logit < best[0]:
                break
            if self._allowed(token) and (best is None or token < best[1]):
                best = (logit, token)
        if best is None or not best[0] > float(logits[-1]):
            return None
        return best[1]

    def _full_row_choice(self, node: int) -> int:
        logits = np.asarray(self.full_row(node), dtype=np.float32)
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"full_row({node}) has shape {logits.shape}, "
                             f"expected ({self.vocab_size},)")
        return masked_argmax(logits, self.grammar_row())

    def grammar_row(self) -> np.ndarray:
        return grammar_row(self.grammar, self.vocab_size)


def xgrammar_take(grammar) -> Callable[[int], bool] | None:
    """For vLLM's xgrammar grammar, `take(token)`: the token tried and, where
    allowed, taken in one matcher call (True), the grammar's own counts kept
    as its `accept_tokens` keeps them; refused, nothing changes (False).
    vLLM's way costs two calls and a rollback (`validate_tokens`, then
    `accept_tokens`), and `accept_tokens` alone logs an error on a refusal.
    None for any other grammar (llguidance, a wrapper): the walk then tries
    and takes with those two."""
    matcher = getattr(grammar, "matcher", None)
    if type(grammar).__name__ != "XgrammarGrammar" or matcher is None \
            or not hasattr(grammar, "_is_terminated") \
            or not hasattr(grammar, "num_processed_tokens"):
        return None

    def take(token: int) -> bool:
        if not matcher.accept_token(token):
            return False
        grammar.num_processed_tokens += 1
        grammar._is_terminated = matcher.is_terminated()
        return True
    return take


def grammar_row(grammar, vocab_size: int) -> np.ndarray:
    """[vocab_size] bool: what vLLM's row allows in the grammar's state (all
    of it once the grammar is terminated)."""
    if grammar.is_terminated():
        return np.ones(vocab_size, dtype=bool)
    words = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    grammar.fill_bitmask(words, 0)
    return unpack_row(words[0].numpy(), vocab_size)


def unpack_row(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """[num_words] int32 bitmask (bit t % 32 of word t // 32: token t
    allowed) -> [vocab_size] bool."""
    bits = np.unpackbits(words.astype("<i4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def masked_argmax(logits: np.ndarray, allowed: np.ndarray) -> int:
    """vLLM's greedy choice under a row: forbidden logits set to -inf, then
    the first maximum (an empty row gives token 0, as argmax of -inf does)."""
    return int(np.where(allowed, logits, -np.inf).argmax())


def node_choices(logits: torch.Tensor, k: int) -> NodeChoices:
    """[num_nodes, vocab] logits -> their unmasked choices on the host (the
    part of a verify step that a GPU would copy: argmax and top-k)."""
    top = torch.topk(logits.float(), k, dim=-1)
    return NodeChoices(logits.argmax(dim=-1).cpu().numpy(), top.indices.cpu().numpy(),
                       top.values.cpu().numpy())
