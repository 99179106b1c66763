"""Fault isolation at the proposer boundary: a faulty proposer costs only
speculation, never the engine.

`SpecplugDrafter` makes every call into the proposer through a
`ProposerGuard`. A call that raises, or a draft that fails `check_draft` /
`check_drafts`, is logged once per kind of failure, counted, and the step
goes on without drafts for the requests concerned (an empty draft is always
valid for vLLM). Past `max_proposer_failures` failures the proposer is
switched off for the engine's life.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm_specplug.drafter")

DEFAULT_MAX_PROPOSER_FAILURES = 8
OPTION = "max_proposer_failures"
NO_DRAFTS_THIS_STEP = "no drafts for them this step"


class InvalidDraftError(ValueError):
    """A draft (or the list of drafts) a proposer returned cannot be used.
    `kind` groups errors for counting and logging."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_int_list(draft: Any) -> list[int]:
    """The draft's ids as Python ints; InvalidDraftError('draft_type') unless
    it is a 1-D list/tuple/ndarray/tensor of integers (bools rejected)."""
    if isinstance(draft, torch.Tensor):
        draft = draft.detach().cpu().numpy()
    if isinstance(draft, np.ndarray):
        if draft.ndim == 1 and np.issubdtype(draft.dtype, np.integer):
            return draft.tolist()
        what = f"ndarray of {draft.dtype} with shape {draft.shape}"
    elif isinstance(draft, (list, tuple)):
        bad = [t for t in draft if not _is_int(t)]
        if not bad:
            return [int(t) for t in draft]
        what = f"{type(draft).__name__} holding {type(bad[0]).__name__} {bad[0]!r}"
    else:
        what = f"{type(draft).__name__}"
    raise InvalidDraftError("draft_type", f"draft is a {what}; expected a 1-D sequence "
                            "of int token ids")


def check_draft(draft: Any, k: int, vocab_size: int) -> list[int]:
    """Validate one request's draft; return it as a list of Python ints."""
    ids = _as_int_list(draft)
    if len(ids) > k:
        raise InvalidDraftError("too_long", f"draft has {len(ids)} tokens; at most {k} "
                                "are allowed this step")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidDraftError("out_of_vocab", f"draft token id {bad[0]} is outside "
                                f"[0, {vocab_size})")
    return ids


def check_drafts(drafts: Any, num_reqs: int) -> list:
    """The list of drafts propose returned: one per request, in order."""
    if not isinstance(drafts, (list, tuple)):
        raise InvalidDraftError("draft_list", f"propose returned a {type(drafts).__name__}; "
                                "expected a list with one draft per request")
    if len(drafts) != num_reqs:
        raise InvalidDraftError("draft_count", f"propose returned {len(drafts)} drafts for "
                                f"{num_reqs} requests")
    return list(drafts)


def check_confidences(confidences: Any, drafts: list) -> list:
    """Per-draft token confidences `propose` returned with its drafts: one
    entry per draft, None or a float in [0, 1] per token of the draft."""
    if not isinstance(confidences, (list, tuple)) or len(confidences) != len(drafts):
        raise InvalidDraftError("confidences", "Drafts.confidences must be a list with one "
                                "entry per draft")
    for draft, values in zip(drafts, confidences):
        if values is None:
            continue
        if len(values) != len(draft) or not all(
                isinstance(v, (int, float)) and 0.0 <= v <= 1.0 for v in values):
            raise InvalidDraftError("confidences", "each Drafts.confidences entry must be None "
                                    "or one number in [0, 1] per draft token")
    return list(confidences)


def parse_max_failures(method: str, value: Any) -> int:
    """Validate the `max_proposer_failures` option (front end)."""
    from vllm_specplug.proposers.base import ProposerConfigError

    if value is None:
        return DEFAULT_MAX_PROPOSER_FAILURES
    if not _is_int(value) or value < 0:
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: {OPTION}={value!r} must be an "
            "int >= 0 (failures tolerated before the proposer is switched off; 0 switches "
            "it off at the first failure)")
    return int(value)


class ProposerGuard:
    """Counts a proposer's failures, logs each kind once, switches it off."""

    def __init__(self, method: str, max_failures: int) -> None:
        self.method = method
        self.max_failures = max_failures
        self.failure_counts: dict[str, int] = {}
        self.disabled = False

    @property
    def num_failures(self) -> int:
        return sum(self.failure_counts.values())

    def call(self, name: str, req_ids: Iterable[str], fn: Callable, *args,
             effect: str = NO_DRAFTS_THIS_STEP) -> tuple[bool, Any]:
        """(True, result) or, if `fn` raised an Exception, (False, None)."""
        try:
            return True, fn(*args)
        except Exception as exc:  # noqa: BLE001 - the point: isolate the proposer
            self.record(f"{name}:{type(exc).__name__}", name, req_ids,
                        f"{type(exc).__name__}: {exc}", exc, effect)
            return False, None

    def record(self, kind: str, name: str, req_ids: Iterable[str], detail: str,
               exc: BaseException | None = None, effect: str = NO_DRAFTS_THIS_STEP) -> None:
        """One failure of `kind` in the proposer's method `name`; `effect`
        says what it costs, for the log."""
        first = kind not in self.failure_counts
        self.failure_counts[kind] = self.failure_counts.get(kind, 0) + 1
        if first:
            logger.error(
                "vllm-specplug proposer %r failed in %s (%s) for request(s) %s; %s "
                "(failure %d, %s=%d; later %r failures are counted, not logged)",
                self.method, name, detail, sorted(req_ids), effect, self.num_failures,
                OPTION, self.max_failures, kind, exc_info=exc)
        if not self.disabled and self.num_failures > self.max_failures:
            self.disabled = True
            logger.error(
                "vllm-specplug proposer %r SWITCHED OFF for the engine's life after %d "
                "failures (%s=%d): %s; generation goes on without speculation",
                self.method, self.num_failures, OPTION, self.max_failures,
                dict(sorted(self.failure_counts.items())))
