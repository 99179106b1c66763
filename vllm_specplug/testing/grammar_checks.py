"""The worker's grammars checked against the outputs they follow, on Model
Runner V2 (issue 30).

With rows in the worker (`grammar_rows: "worker"`) the head's V2 speculator
keeps its own grammar of each constrained request (`DraftGrammars`),
advanced by what it reads or decides of the outputs: by each drafting pass
(`StructuredRequests._grammars`, read from the device or, after the
target's choices, advanced by the tokens the walk decided and confirmed
later), then used for the next step's rows (`verifying_grammars`). A grammar
one token off its output fills wrong rows, and an output may still come out
right where those rows happen to allow the same choice. `worker_grammar_checks`
compares each grammar, wherever it is used, with a fresh xgrammar matcher
advanced by the request's output read from the device: its next-token row
must be the same. Each mismatch is kept with the step, the way the step
verified (the target's choices or every node's row), the grammar's counts
and the tokens the host decided.

The checks read the outputs from the device at every use: a wait for the
GPU that the product does not make, so a run with them is timed apart from
one without. The engine core must run in the caller's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the checks patch the classes there.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

MAX_EVENTS = 400  # steps' ways and decided tokens kept (the first ones)


@dataclass
class GrammarChecks:
    """What `worker_grammar_checks` saw: the checks made, the mismatches,
    and each verification step's way (`events`)."""
    num_checks: dict[str, int] = field(default_factory=lambda: {"verify": 0, "draft": 0})
    mismatches: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    pending: list[dict] = field(default_factory=list)  # a verification step's, before its way

    def check(self, where: str, step: int, req_id: str, grammar, tracked, output,
              known: list[int] | None = None) -> dict | None:
        """Compare `grammar` with `output` (the request's output so far, cut
        at max_tokens); the mismatch recorded, or None."""
        self.num_checks[where] += 1
        if same_row_as_output(grammar, output):
            return None
        entry = {"where": where, "step": step, "req_id": req_id,
                 "num_accepted": tracked.num_accepted if tracked else None,
                 "num_processed": getattr(grammar, "num_processed_tokens", None),
                 "terminated": grammar.is_terminated(), "output_len": len(output),
                 "output_tail": [int(t) for t in output[-8:]],
                 "known": None if known is None else [int(t) for t in known],
                 "unconfirmed": (None if tracked is None or tracked.unconfirmed is None
                                 else [int(t) for t in tracked.unconfirmed])}
        self.mismatches.append(entry)
        return entry

    def event(self, **kwargs) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(kwargs)


def same_row_as_output(grammar, output) -> bool:
    """Whether vLLM's xgrammar `grammar` has the next-token row of a fresh
    matcher of its compiled grammar advanced by `output` (up to where that
    one ends); a terminated grammar matches a terminated one only."""
    import xgrammar as xgr

    fresh = xgr.GrammarMatcher(grammar.ctx,
                               override_stop_tokens=list(grammar.matcher.stop_token_ids))
    for token in [int(t) for t in output]:
        if fresh.is_terminated():
            break
        if not fresh.accept_token(token):
            return False
    if fresh.is_terminated() or grammar.is_terminated():
        return fresh.is_terminated() == grammar.is_terminated()
    rows = torch.zeros((2, (grammar.vocab_size + 31) // 32), dtype=torch.int32)
    fresh.fill_next_token_bitmask(rows, 0)
    grammar.fill_bitmask(rows, 1)
    return bool(torch.equal(rows[0], rows[1]))


def _device_outputs(structured, req_states, input_batch, req_ids: list[str]) -> dict:
    """{req_id: its output so far (None: none yet)}, read from the device."""
    if not req_ids:
        return {}
    row_of = {r: b for b, r in enumerate(input_batch.req_ids[:input_batch.num_reqs])}
    slots = input_batch.idx_mapping_np[:input_batch.num_reqs][[row_of[r] for r in req_ids]]
    return dict(zip(req_ids, structured._outputs(req_states, slots)))


def _cut(structured, req_id: str, output):
    max_tokens = getattr(structured.params[req_id], "max_tokens", None)
    return output if max_tokens is None else output[:max_tokens]


@contextmanager
def worker_grammar_checks(allow_auto_on_v2: bool = False) -> Iterator[GrammarChecks]:
    """Check every use of the V2 speculator's grammars while the block runs
    (the classes patched, then restored). `allow_auto_on_v2`: lift Model
    Runner V2's refusal of `grammar_verify: "auto"` too, for diagnosis."""
    from vllm_specplug.integration.grammar_choices import GrammarChoices
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    from vllm_specplug.integration.v2.structured import StructuredRequests
    from vllm_specplug.proposers.eagle3 import TreeOptions

    checks = GrammarChecks()
    saved = [(StructuredRequests, "verifying_grammars"), (StructuredRequests, "_grammars"),
             (SpecplugV2HeadSpeculator, "_verification_rows"), (GrammarChoices, "correct")]
    if allow_auto_on_v2:
        saved.append((TreeOptions, "check_model_runner_v2"))
    # (owner, name, its own attribute or None where it inherits it: a mixin's)
    originals = [(owner, name, owner.__dict__.get(name)) for owner, name in saved]
    _install(checks, allow_auto_on_v2)
    try:
        yield checks
    finally:
        for owner, name, own in originals:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def _install(checks: GrammarChecks, allow_auto_on_v2: bool) -> None:
    from vllm_specplug.integration.grammar_choices import GrammarChoices
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    from vllm_specplug.integration.v2.structured import StructuredRequests
    from vllm_specplug.proposers.eagle3 import TreeOptions

    verifying, grammars = StructuredRequests.verifying_grammars, StructuredRequests._grammars
    rows, correct = SpecplugV2HeadSpeculator._verification_rows, GrammarChoices.correct

    def verifying_grammars(self, req_ids, input_batch, req_states):
        found = verifying(self, req_ids, input_batch, req_states)
        outputs = _device_outputs(self, req_states, input_batch, list(found))
        for req_id, grammar in found.items():
            if outputs[req_id] is not None:
                entry = checks.check("verify", self.step, req_id, grammar,
                                     self.grammars.tracked.get(req_id),
                                     _cut(self, req_id, outputs[req_id]))
                if entry is not None:
                    checks.pending.append(entry)
        return found

    def drafting_grammars(self, input_batch, req_states, known=None):
        found = grammars(self, input_batch, req_states, known)
        if found is None:
            return found
        used = {req_id: grammar for req_id, grammar in zip(*found) if grammar is not None}
        outputs = _device_outputs(self, req_states, input_batch, list(used))
        for req_id, grammar in used.items():
            if outputs[req_id] is not None:
                checks.check("draft", self.step, req_id, grammar,
                             self.grammars.tracked.get(req_id),
                             _cut(self, req_id, outputs[req_id]), (known or {}).get(req_id))
        return found

    def verification_rows(self, runner, input_batch, req_ids, grammar_output):
        choices = self.grammar_choices
        before = choices.num_steps_with_rows if choices is not None else 0
        result = rows(self, runner, input_batch, req_ids, grammar_output)
        way = ("rows" if choices is None or choices.num_steps_with_rows > before
               or not choices.planned else "choices")
        for entry in checks.pending:
            entry["way"] = way
        checks.pending = []
        checks.event(kind="verify", step=self.structured.step, way=way, req_ids=list(req_ids))
        return result

    def corrected(self, logits, target_tokens, input_batch):
        cut = correct(self, logits, target_tokens, input_batch)
        checks.event(kind="emitted", emitted={k: [int(t) for t in v]
                                              for k, v in self.emitted.items()}, cut=len(cut))
        return cut

    StructuredRequests.verifying_grammars = verifying_grammars
    StructuredRequests._grammars = drafting_grammars
    SpecplugV2HeadSpeculator._verification_rows = verification_rows
    GrammarChoices.correct = corrected
    if allow_auto_on_v2:
        TreeOptions.check_model_runner_v2 = lambda self: None
