"""The proposer interface: what every method registered by name implements.

A proposer lives in the worker process. The runtime (`proposers/runtime.py`)
drives its per-request lifecycle from vLLM's batch state and calls `propose`
once per step for the requests that may be speculated on. Proposers never
import vLLM: they see only the small dataclasses below.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch


class ProposerConfigError(ValueError):
    """A speculative_config entry of ours is wrong; the message names the
    field and the accepted values."""


class StopReason(enum.Enum):
    FINISHED = "finished"  # finished or aborted: the request is gone
    PREEMPTED = "preempted"  # will come back with the same id and history


@dataclass(frozen=True)
class ProposerOptions:
    """Base of each proposer's options. Subclasses add typed fields with
    defaults and may override `validate` for ranges; `from_dict` rejects
    unknown keys and wrong types with the field's name."""

    @classmethod
    def from_dict(cls, name: str, raw: dict[str, Any]) -> "ProposerOptions":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ProposerConfigError(
                f"speculative_config for method {name!r}: unknown option(s) {unknown}; "
                f"accepted: {sorted(fields) or 'none'}")
        hints = typing.get_type_hints(cls)
        for key, value in raw.items():
            _check_type(name, key, value, hints[key])
        options = cls(**raw)
        options.validate(name)
        return options

    def validate(self, name: str) -> None:
        """Range checks; raise ProposerConfigError naming the field."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_type(name: str, key: str, value: Any, hint: Any) -> None:
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    allowed = typing.get_args(hint) if is_union else (hint,)
    allowed = tuple(typing.get_origin(a) or a for a in allowed)
    ok = any(_matches(value, a) for a in allowed)
    if not ok:
        wanted = " or ".join(getattr(a, "__name__", str(a)) for a in allowed)
        raise ProposerConfigError(
            f"speculative_config for method {name!r}: {key}={value!r} must be {wanted}")


def _matches(value: Any, kind: Any) -> bool:
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ProposerConfigError(f"speculative_config for method {name!r}: {message}")


@dataclass(frozen=True)
class ProposerContext:
    """Engine facts a proposer may need, fixed for the engine's life."""
    num_speculative_tokens: int  # the most draft tokens per request per step
    max_model_len: int
    vocab_size: int
    device: str


@dataclass
class ProposeBatch:
    """One step's requests that may be speculated on, in batch order.

    Histories (prompt + accepted output, no speculative tokens) are rows of
    one 2-D buffer so that proposers can work on the whole batch at once;
    the buffer is a read-only view valid only during `propose`.
    """
    req_ids: list[str]
    token_ids: np.ndarray  # [num_reqs, max_len] int32; row i valid up to num_tokens[i]
    num_tokens: np.ndarray  # [num_reqs] int64
    num_spec_tokens: int  # the most draft tokens the scheduler allows this step
    hidden_states: torch.Tensor | None = None  # [num_reqs, hidden] target's last hidden state; model-based proposers only
    # Rows under a grammar (structured outputs): row -> how many leading
    # tokens of a candidate draft the grammar allows after the row's output.
    # vLLM's scheduler cuts a draft at its first forbidden token, so a
    # proposer that has other candidates may prefer allowed ones (selection
    # only: verification, and so the output, is unchanged).
    valid_prefix: dict[int, typing.Callable[[list[int]], int]] = dataclasses.field(
        default_factory=dict)

    def history(self, i: int) -> np.ndarray:
        return self.token_ids[i, :self.num_tokens[i]]

    def rows(self, rows: list[int]) -> "ProposeBatch":
        """The batch of `rows` only, in that order (composite proposers)."""
        valid_prefix = {j: self.valid_prefix[i] for j, i in enumerate(rows)
                        if i in self.valid_prefix}
        hidden = None if self.hidden_states is None else self.hidden_states[rows]
        return ProposeBatch([self.req_ids[i] for i in rows], self.token_ids[rows],
                            self.num_tokens[rows], self.num_spec_tokens, hidden, valid_prefix)


@dataclass
class DeviceProposeBatch:
    """One step's requests, with their histories where the model runner
    keeps them on the device (Model Runner V2's `req_states`), indexed by
    state slot rather than batch row. Valid only during `propose`."""
    req_ids: list[str]
    token_ids: torch.Tensor  # [max_num_reqs, max_len] int32, device; slot s valid up to num_tokens[s]
    idx_mapping: torch.Tensor  # [num_reqs] int, device: batch row -> state slot
    num_tokens: torch.Tensor  # [max_num_reqs] int32, device: history length per slot
    num_sampled: torch.Tensor  # [num_reqs] int32, device: 0 for a partial prefill (no draft)
    # [2] int64, device, or None: a drafter that counts adds (draft tokens,
    # draft slots = K per row with num_sampled > 0) here, without a sync
    draft_counts: torch.Tensor | None = None


class DeviceDrafter(ABC):
    """Drafts on the device with no host synchronisation (see
    `Proposer.device_drafter`). Runs without the per-request lifecycle."""
    # True: every id it writes is in the vocabulary by construction, so the
    # adapter skips its range check (four small launches a step).
    trusted: ClassVar[bool] = False

    @abstractmethod
    def propose(self, batch: DeviceProposeBatch, draft_ids: torch.Tensor,
                num_draft: torch.Tensor) -> None:
        """Write each row's draft into `draft_ids` ([num_reqs, K] int64),
        padded to K with the row's last token, and its unpadded length into
        `num_draft` ([num_reqs] int32)."""


class Drafts(list):
    """What `propose` may return instead of a plain list of drafts: that list
    (so it reads as one), carrying per draft the proposer's confidence in
    each token, the chance it is accepted given that the tokens before it
    are, in [0, 1] (None for a draft without one). The adaptive controller
    calibrates them against what verification accepts
    (adaptive/acceptance.py)."""

    def __init__(self, token_ids: list[list[int]], confidences: list[list[float] | None]):
        super().__init__(token_ids)
        self.confidences = confidences

    @property
    def token_ids(self) -> list[list[int]]:
        return self


class Proposer(ABC):
    """A speculative proposer selected by name.

    Lifecycle, per request id: `start_request` once (prompt known), then
    `update_request` with each step's newly accepted tokens, then
    `stop_request` when it finishes, is aborted, or is preempted (a preempted
    request is started again if it resumes). `propose` returns one draft per
    request, of any length from 0 to `batch.num_spec_tokens` (variable-length
    drafts are allowed; an empty draft means "no speculation this step"),
    as a list or as `Drafts` with per-token confidences.
    """
    options_cls: ClassVar[type[ProposerOptions]] = ProposerOptions
    uses_hidden_states: ClassVar[bool] = False
    # Reads `ProposeBatch.valid_prefix` (drafts under structured outputs);
    # where False the drafter skips the grammar work
    reads_grammars: bool = False
    # Runs under vLLM's Model Runner V2 on CUDA (integration/v2/speculator.py);
    # False keeps the method on the V1 runner, whose patches it needs.
    runs_on_model_runner_v2: ClassVar[bool] = True
    # Its drafts are chains the adaptive controller may cut per request
    # (vllm_specplug/adaptive/); on by default where both are True.
    supports_adaptive: ClassVar[bool] = True
    adaptive_by_default: ClassVar[bool] = True
    # The object vLLM's `custom_class` instantiates in the worker for this method.
    drafter_qualname: ClassVar[str] = "vllm_specplug.integration.v1.drafter.SpecplugDrafter"

    @classmethod
    def vllm_num_speculative_tokens(cls, options: ProposerOptions,
                                    num_speculative_tokens: int | None) -> int | None:
        """The per-step draft allowance vLLM's scheduler is given (None: the
        user must set num_speculative_tokens)."""
        return num_speculative_tokens

    @classmethod
    def fills_draft_confidences(cls, options: ProposerOptions) -> bool:
        """Whether, on Model Runner V2, it fills the per-position confidences
        of vLLM's adaptive verification (`enable_adaptive_verification`):
        vLLM then admits a step's best draft slots under its measured cost
        curve. Model-free methods cut their drafts with `adaptive` instead."""
        return False

    @classmethod
    def check_target(cls, name: str, options: ProposerOptions, target_hf) -> None:
        """Front-end check against the target's HF config (before the engine
        starts); raise ProposerConfigError naming the field."""

    def __init__(self, options: ProposerOptions, context: ProposerContext) -> None:
        self.options = options
        self.context = context

    def start_request(self, req_id: str, prompt_token_ids: np.ndarray) -> None:
        """A new request (or a preempted one resuming)."""

    def update_request(self, req_id: str, new_token_ids: list[int]) -> None:
        """Tokens accepted for `req_id` in the last step (bonus included)."""

    def stop_request(self, req_id: str, reason: StopReason) -> None:
        """The request left the batch."""

    @abstractmethod
    def propose(self, batch: ProposeBatch) -> list[list[int]] | Drafts:
        """Drafts for every request of `batch`, in order."""

    def device_drafter(self, max_num_reqs: int) -> DeviceDrafter | None:
        """A drafter that works on the device-resident histories of Model
        Runner V2, used there instead of `propose` and the lifecycle (None:
        the host path). It must draft what `propose` would."""
        return None
