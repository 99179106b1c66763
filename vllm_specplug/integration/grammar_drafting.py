"""Drafts that know the grammar (structured outputs on the V1 runner).

Under a grammar the scheduler prunes every draft node the grammar forbids on
its path (grammar_trees.py), so a drafter that ranks the whole vocabulary
spends its tree on nodes that are cut before verification: on the tiny model
under a JSON schema a 16-node tree fell from 3.48 to 2.43 tokens a step.
Here each drafting step's logits are masked, node by node, to the tokens the
grammar allows after that node's own path, before the top-k (SGLang masks
its verification the same way, per node: `generate_token_bitmask`): the
same tree then gives 4.20 (benchmarks/bench_grammar_trees.py).

The drafter keeps its own grammar per request: the scheduler's lives in the
engine core's process (the worker runs in another) and sits one step
behind. It is
compiled by vLLM's `StructuredOutputManager` in the worker, so the backend
(xgrammar, guidance, ...) and its options are the scheduler's, and advanced
by each step's verified tokens. Selection only: the masks change which
tokens are drafted, never what is verified, so any mask is lossless.
Requests whose grammar starts after a reasoning section are drafted
unmasked (the drafter does not track where reasoning ends).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

logger = logging.getLogger("vllm_specplug.grammar_drafting")


def _within_max_tokens(token_ids: list[int], sampling_params, num_accepted: int) -> list[int]:
    """`token_ids` cut where the request reaches max_tokens, `num_accepted`
    output tokens taken already, as `DraftGrammars._advanced` cuts the output."""
    max_tokens = getattr(sampling_params, "max_tokens", None)
    if max_tokens is None:
        return token_ids
    return token_ids[:max(0, max_tokens - num_accepted)]


def prefix_check(grammar):
    """`ProposeBatch.valid_prefix`'s check for one request: how many leading
    tokens of a candidate draft `grammar` (advanced to the request's output)
    allows."""
    return lambda token_ids: len(grammar.validate_tokens(token_ids))


@dataclass
class _Tracked:
    """One request's grammar as the drafter sees it."""
    holder: SimpleNamespace  # what vLLM's manager compiles into (`structured_output_request`)
    num_accepted: int = 0    # output tokens the grammar has accepted
    broken: bool = False     # compile failed or a verified token was refused: unmasked
    # the last of those tokens as the host decided them (`advance_known`),
    # not yet seen in the request's output, and the grammar's advances for them
    unconfirmed: list[int] | None = None
    num_unconfirmed_advances: int = 0
    # those tokens' advances were the verification walk's (`keep_known`):
    # the drafting pass that follows finds the grammar advanced already
    walked: bool = False


@dataclass
class DraftGrammars:
    """{req_id: grammar} of the requests with structured output, for their
    drafts. `vllm_config` builds vLLM's manager on the first such request."""
    vllm_config: object
    manager: object | None = None
    tracked: dict[str, _Tracked] = field(default_factory=dict)
    num_masked_passes: int = 0  # drafting passes that masked at least one request
    # requests advanced by tokens the host decided (`advance_known`), and
    # those whose output then differed (rolled back and advanced by it)
    num_known_advances: int = 0
    num_known_repairs: int = 0
    first_step_only: bool = False  # mask the first drafting step only (the root's row)
    # [V_draft] int64 on the host: the target id of each of the head's draft
    # ids (taken from the head's layer at the first masked pass)
    draft_to_target: torch.Tensor | None = None

    def grammar_of(self, req_id: str, sampling_params,
                   output_token_ids: np.ndarray):
        """The request's grammar advanced to `output_token_ids` (all its
        output so far, the root of its next tree last); None: unconstrained,
        not compiled yet, broken or terminated."""
        grammar = self._advanced(req_id, sampling_params, output_token_ids, wait=False)
        return None if grammar is None or grammar.is_terminated() else grammar

    def verifying_grammar(self, req_id: str, sampling_params,
                          output_token_ids: np.ndarray | None):
        """`grammar_of` for a step's verification rows (worker_rows.py): it
        waits for the compile, and a terminated grammar is returned too (its
        rows allow everything, as vLLM's); None: unconstrained or broken.
        `output_token_ids` None: as far as the grammar was advanced."""
        return self._advanced(req_id, sampling_params, output_token_ids, wait=True)

    def _advanced(self, req_id: str, sampling_params, output_token_ids: np.ndarray | None,
                  wait: bool):
        tracked = self.tracked.get(req_id)
        if tracked is None:
            if not is_constrained(sampling_params) or not self._start(req_id, sampling_params):
                return None
            tracked = self.tracked[req_id]
        if tracked.broken:
            return None
        holder = tracked.holder.structured_output_request
        if wait and isinstance(holder._grammar, Future):
            holder._grammar.exception()  # blocks until compiled (or failed)
        grammar = holder.grammar
        if grammar is None:  # still compiling: its tokens wait
            return None
        if isinstance(grammar, Exception):
            tracked.broken = True
            return None
        if output_token_ids is None:
            return grammar
        max_tokens = getattr(sampling_params, "max_tokens", None)
        if max_tokens is not None:
            # a verify step can sample past max_tokens (a tree's path is not
            # cut there); vLLM drops those tokens, their rows need not be the
            # grammar's, and feeding them logged vLLM's "Failed to advance
            # FSM" on the H200 (docs/results/v2_schema_threads_h200)
            output_token_ids = output_token_ids[:max_tokens]
        if tracked.unconfirmed is not None:
            self._confirm(req_id, tracked, grammar, output_token_ids)
        new = output_token_ids[tracked.num_accepted:].tolist()
        if new and not grammar.accept_tokens(req_id, new):
            logger.warning("vllm-specplug: request %s: the drafter's grammar refused a "
                           "verified token (output tokens %d-%d of %d: %s; terminated "
                           "%s); its drafts go unmasked", req_id, tracked.num_accepted,
                           len(output_token_ids) - 1, len(output_token_ids), new[:8],
                           grammar.is_terminated())
            tracked.broken = True
            return None
        tracked.num_accepted = len(output_token_ids)
        return grammar

    def advance_known(self, req_id: str, sampling_params, token_ids: list[int]) -> bool:
        """Advance the request's grammar by `token_ids`, the tokens its last
        step emitted as the host decided them (grammar_choices.py), without
        reading its output. They stay unconfirmed until the next output
        passed to this object shows them (`_confirm`). False, nothing done:
        no usable grammar, or tokens still unconfirmed (read the output)."""
        tracked = self.tracked.get(req_id)
        if tracked is not None and tracked.walked:  # `keep_known` advanced it by them
            tracked.walked = False
            return tracked.unconfirmed == list(token_ids)
        if tracked is None or tracked.broken or tracked.unconfirmed is not None:
            return False
        grammar = tracked.holder.structured_output_request.grammar
        if grammar is None or isinstance(grammar, Exception):
            return False
        token_ids = _within_max_tokens(token_ids, sampling_params, tracked.num_accepted)
        num_advances = 0
        for token in token_ids:
            if grammar.is_terminated():  # vLLM ignores tokens after the end
                break
            if not grammar.accept_tokens(req_id, [token]):
                grammar.rollback(num_advances)
                return False
            num_advances += 1
        self._record_known(tracked, token_ids, num_advances)
        return True

    def keep_known(self, req_id: str, sampling_params, token_ids: list[int],
                   num_advances: int) -> bool:
        """`advance_known` for a grammar the greedy walk of verification
        (grammar_choices.py) has advanced by `token_ids` already, with
        `num_advances` of its own: the same bookkeeping, none of the
        grammar's work again (every token had been accepted twice, and
        rolled back once, a step). False, nothing recorded (the caller rolls
        the walk back): no usable grammar, tokens still unconfirmed, or
        tokens past max_tokens (`advance_known` would feed fewer)."""
        tracked = self.tracked.get(req_id)
        if tracked is None or tracked.broken or tracked.unconfirmed is not None:
            return False
        if len(_within_max_tokens(token_ids, sampling_params,
                                  tracked.num_accepted)) < len(token_ids):
            return False
        self._record_known(tracked, token_ids, num_advances)
        tracked.walked = True
        return True

    def _record_known(self, tracked: _Tracked, token_ids: list[int], num_advances: int) -> None:
        """The grammar advanced by `token_ids` (`num_advances` of its own),
        unconfirmed until the output shows them (`_confirm`)."""
        tracked.num_accepted += len(token_ids)
        tracked.unconfirmed, tracked.num_unconfirmed_advances = list(token_ids), num_advances
        self.num_known_advances += 1

    def _confirm(self, req_id: str, tracked: _Tracked, grammar,
                 output_token_ids: np.ndarray) -> None:
        """The tokens `advance_known` took, checked against the request's
        output (cut at max_tokens): where they differ, the grammar is rolled
        back to before them, and `_advanced` then feeds it the output."""
        known, end = tracked.unconfirmed, tracked.num_accepted
        start = end - len(known)
        tracked.unconfirmed, tracked.walked = None, False
        if len(output_token_ids) >= end and output_token_ids[start:end].tolist() == known:
            return
        logger.warning("vllm-specplug: request %s: its output %s differs from the tokens %s "
                       "decided on the host at positions %d-%d; its drafter's grammar is "
                       "advanced by the output instead", req_id,
                       output_token_ids[start:end].tolist(), known, start, end - 1)
        grammar.rollback(tracked.num_unconfirmed_advances)
        tracked.num_accepted = start
        self.num_known_repairs += 1

    def forget(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)

    def of_row(self, runner, row: int, verifying: bool = False):
        """`grammar_of` the request in `row` of the V1 runner's input batch,
        advanced to its output so far (None: no grammar to draft under);
        `verifying`: `verifying_grammar`'s instead (a terminated one too)."""
        batch = runner.input_batch
        req_id = batch.req_ids[row]
        state = runner.requests.get(req_id)
        if state is None or state.sampling_params is None:
            return None
        start, end = int(batch.num_prompt_tokens[row]), int(batch.num_tokens_no_spec[row])
        of = self.verifying_grammar if verifying else self.grammar_of
        return of(req_id, state.sampling_params, batch.token_ids_cpu[row, start:end])

    def _start(self, req_id: str, sampling_params) -> bool:
        """Submit the request's grammar to vLLM's manager (compiled on its
        threads, as the scheduler's is); False: masking is off for it."""
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.structured_output.request import StructuredOutputRequest

        if self.manager is None:
            self.manager = StructuredOutputManager(self.vllm_config)
        if self.manager.reasoner_cls is not None:
            return False
        holder = SimpleNamespace(
            request_id=req_id, sampling_params=sampling_params,
            structured_output_request=StructuredOutputRequest.from_sampling_params(
                sampling_params))
        self.manager.grammar_init(holder)
        self.tracked[req_id] = _Tracked(holder)
        return True

    def masks(self, req_ids: list[str], grammars: list, layer, device):
        """A `HeadRuntime.tree_logits_hook` for one drafting pass over
        `req_ids` (grammars[b]: that request's, or None) of the head whose
        draft layer is `layer`, on `device`; None when no request of the
        pass has one."""
        if all(grammar is None for grammar in grammars):
            return None
        if self.draft_to_target is None:
            ids = torch.arange(layer.logits_size, device=device)
            self.draft_to_target = layer.to_target(ids).cpu()
        self.num_masked_passes += 1
        return PathMasks(req_ids, grammars, self.draft_to_target,
                         self.manager.backend.allocate_token_bitmask, self.first_step_only)


def is_constrained(sampling_params) -> bool:
    params = getattr(sampling_params, "structured_outputs", None)
    return params is not None and not params.all_constraints_none()


class PathMasks:
    """Each drafting step's logits masked, per beam node, to the tokens the
    grammar allows after that node's path (root's children: after the
    request's output). A node on an invalid path (score -inf, or a token
    the grammar refuses), past the grammar's end, or whose allowed tokens
    are all outside the head's draft vocabulary keeps its logits: a row all
    -inf would make the log-softmax NaN, and the scheduler prunes what the
    grammar forbids."""

    def __init__(self, req_ids: list[str], grammars: list, draft_to_target: torch.Tensor,
                 allocate, first_step_only: bool = False) -> None:
        self.req_ids, self.grammars = req_ids, grammars
        self.draft_to_target = draft_to_target  # [V_draft] int64: target id of each draft id
        self.allocate = allocate  # rows -> [rows, words] int32 bitmask, all allowed
        # the later steps' logits left alone: no read of the beam, no fill
        self.first_step_only = first_step_only

    def __call__(self, logits: torch.Tensor, slots, pooled, beam) -> torch.Tensor:
        """logits [B, V_draft] (first step) or [B, k, V_draft]; pooled/beam:
        `HeadRuntime._draft_tree_pass`'s candidate pool and beam."""
        if self.first_step_only and pooled is not None:
            return logits
        batch = len(self.grammars)
        width = 1 if pooled is None else beam.shape[1]
        bitmask = self.allocate(batch * width)
        filled = np.zeros(batch * width, dtype=bool)
        paths = None if pooled is None else _beam_paths(pooled, beam)
        for b, grammar in enumerate(self.grammars):
            if grammar is None:
                continue
            for j in range(width):
                path = [] if paths is None else paths[b][j]
                if path is not None:
                    filled[b * width + j] = self._fill(grammar, self.req_ids[b], path,
                                                       bitmask, b * width + j)
        if not filled.any():
            return logits
        index = torch.from_numpy(np.flatnonzero(filled))
        allowed = draft_bits(bitmask[index], self.draft_to_target).to(logits.device)
        allowed |= ~allowed.any(-1, keepdim=True)  # no draft id allowed: the row stays
        index = index.to(logits.device)
        rows = logits.reshape(batch * width, -1).clone()
        rows[index] = rows[index].masked_fill(~allowed, float("-inf"))
        return rows.view_as(logits)

    @staticmethod
    def _fill(grammar, req_id: str, path: list[int], bitmask: torch.Tensor, row: int) -> bool:
        """Row `row` of `bitmask` in the state after `path`; False: not filled.
        A path is validated first: below a row left unmasked (no allowed
        draft id) a finite score does not mean an allowed token, and a
        refused accept would leave the grammar part way down the path."""
        if path and len(grammar.validate_tokens(path)) < len(path):
            return False
        grammar.accept_tokens(req_id, path)  # validated: accepted whole
        try:
            if grammar.is_terminated():
                return False
            grammar.fill_bitmask(bitmask, row)
            return True
        finally:
            if path:
                grammar.rollback(len(path))


def _beam_paths(pooled, beam) -> list[list[list[int] | None]]:
    """Target token ids from the root's child down to each beam node ([B][k];
    None: a node on a path the masks ruled out, score -inf)."""
    token_ids = pooled.token_ids.cpu().numpy()
    parent_ids = pooled.parent_ids.cpu().numpy()
    finite = torch.isfinite(pooled.scores).cpu().numpy()
    paths = []
    for b, nodes in enumerate(beam.cpu().numpy()):
        row = []
        for node in nodes.tolist():
            if not finite[b, node]:
                row.append(None)
                continue
            path = []
            while node >= 0:
                path.append(int(token_ids[b, node]))
                node = int(parent_ids[b, node])
            row.append(path[::-1])
        paths.append(row)
    return paths


def draft_bits(bitmask: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """[rows, V_draft] bool: whether each row's bitmask ([rows, words] int32,
    bit t of word w: target token 32w + t) allows each draft id's target
    token. Only the head's ids are read: a draft vocabulary of 8192 reads
    8192 bits a row, not the target's 49152."""
    words = bitmask[:, draft_to_target >> 5]
    return ((words >> (draft_to_target & 31).to(torch.int32)) & 1).bool()
