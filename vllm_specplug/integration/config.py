"""Translate `speculative_config={"method": <our name>, ...}` for vLLM.

vLLM's `SpeculativeConfig.method` is a fixed Literal; its one extension is
`method="custom_class"`. We validate our proposer's options here, in the
front-end process where the user sees the error, hand vLLM a custom_class
config pointing at our drafter adapter, and attach the selection to the
resulting config object, which travels to the worker with the VllmConfig.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any

from vllm_specplug.integration.guard import (DEFAULT_MAX_PROPOSER_FAILURES, OPTION as
                                             MAX_FAILURES_OPTION, parse_max_failures)
from vllm_specplug.proposers.base import ProposerConfigError
from vllm_specplug.registry import (UnknownProposerError, available_proposers,
                                    get_proposer_class, is_registered)

SELECTION_ATTR = "specplug_selection"
ADAPTIVE_OPTION = "adaptive"
# `"adaptive_focus": true`: with the batch policy, a draining batch (nothing
# waiting) weighs each length by its slowest request (adaptive/wave_focus.py)
FOCUS_OPTION = "adaptive_focus"
# `"adaptive": "batch"`: one draft length per step for the whole batch
BATCH_MODE = "batch"
# `"token_history": "device" | "host"`: where Model Runner V2 keeps the
# requests' token histories (integration/v2/token_history.py)
TOKEN_HISTORY_OPTION = "token_history"
TOKEN_HISTORY_PLACES = ("device", "host")
# vLLM's SpeculativeConfig field for its adaptive verification (Model Runner V2)
ADAPTIVE_VERIFICATION_FIELD = "enable_adaptive_verification"


@dataclass(frozen=True)
class ProposerSelection:
    method: str
    options_json: str  # validated options, JSON so the selection pickles anywhere
    # Failures tolerated before the proposer is switched off (integration/guard.py).
    max_proposer_failures: int = DEFAULT_MAX_PROPOSER_FAILURES
    # Per-request draft lengths chosen each step (vllm_specplug/adaptive/):
    # "auto" (the default where the method supports it: on, except where a
    # device drafter keeps drafts off the host), "on" (forced), "batch" (one
    # length per step for the whole batch on any runner:
    # integration/batch_schedule.py) or "off".
    adaptive: str = "off"
    # with the batch policy: weigh a draining batch by its slowest request
    adaptive_focus: bool = False
    # Model Runner V2's token histories: "auto" (in device memory where our
    # speculator scans them on the GPU), "device" or "host" (vLLM's pinned
    # host memory read through UVA)
    token_history: str = "auto"

    @property
    def options(self) -> dict[str, Any]:
        return json.loads(self.options_json)


def vllm_methods() -> list[str]:
    from vllm.config.speculative import SpeculativeMethod

    names: list[str] = []
    for arg in typing.get_args(SpeculativeMethod):  # a union of Literals
        names += list(typing.get_args(arg)) or [arg]
    return names


def _vllm_fields() -> set[str]:
    from vllm.config.speculative import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def check_method(method: Any) -> None:
    """Unknown names fail here, listing ours and vLLM's."""
    if method is None or is_registered(method) or method in vllm_methods():
        return
    raise UnknownProposerError(
        f"speculative_config method={method!r} is unknown; vllm-specplug "
        f"proposers: {available_proposers()}; vLLM methods: {vllm_methods()}")


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], ProposerSelection] | None:
    """(dict vLLM accepts, our selection) when `raw` selects one of ours."""
    method = raw.get("method")
    check_method(method)
    if not is_registered(method):
        return None
    cls = get_proposer_class(method)
    max_failures = parse_max_failures(method, raw.get(MAX_FAILURES_OPTION))
    adaptive = parse_adaptive(method, raw.get(ADAPTIVE_OPTION), cls.supports_adaptive,
                              cls.adaptive_by_default)
    focus = parse_focus(method, raw.get(FOCUS_OPTION), adaptive)
    history = parse_token_history(method, raw.get(TOKEN_HISTORY_OPTION))
    general = (MAX_FAILURES_OPTION, ADAPTIVE_OPTION, FOCUS_OPTION, TOKEN_HISTORY_OPTION)
    raw = {k: v for k, v in raw.items() if k not in general}
    ours = {f.name for f in dataclasses.fields(cls.options_cls)}
    options = {k: v for k, v in raw.items() if k in ours}
    rest = {k: v for k, v in raw.items() if k not in ours and k != "method"}
    if "model" in rest:
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: 'model' is not accepted; "
            f"options of this method: {sorted(ours) or 'none'}")
    unknown = sorted(set(rest) - _vllm_fields())
    if unknown:
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: unknown option(s) {unknown}; "
            f"accepted: {sorted(ours)} plus {', '.join(general)} and vLLM's "
            "speculative_config fields")
    parsed = cls.options_cls.from_dict(method, options)
    num_spec = cls.vllm_num_speculative_tokens(parsed, rest.get("num_speculative_tokens"))
    if num_spec is None:
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: num_speculative_tokens is "
            "required (the most draft tokens per request per step)")
    if hasattr(parsed, "resolved"):
        parsed = parsed.resolved(rest.get("num_speculative_tokens"))
    check_adaptive_verification(method, cls, parsed, rest)
    check_draft_tensor_parallel(method, rest)
    selection = ProposerSelection(method, json.dumps(parsed.to_dict(), sort_keys=True),
                                  max_failures, adaptive, focus, history)
    return {**rest, "num_speculative_tokens": num_spec, "method": "custom_class",
            "model": cls.drafter_qualname}, selection


def parse_focus(method: str, value: Any, adaptive: str) -> bool:
    """`adaptive_focus` (default false): only beside a batch policy."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: {FOCUS_OPTION}={value!r} must be "
            "true or false (true: while nothing waits, the batch's draft length is weighed "
            "by its request with the most steps left)")
    if value and adaptive not in ("on", BATCH_MODE):
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: {FOCUS_OPTION}=true steers the "
            f"batch policy: set {ADAPTIVE_OPTION} to true or {BATCH_MODE!r} too, or drop it")
    return value


def parse_token_history(method: str, value: Any) -> str:
    """`token_history` (default "auto"): where Model Runner V2 keeps the
    requests' token histories."""
    if value is None:
        return "auto"
    if value not in TOKEN_HISTORY_PLACES:
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: {TOKEN_HISTORY_OPTION}={value!r} must "
            "be 'device' (the histories in GPU memory, as vLLM keeps them for its ngram "
            "method) or 'host' (vLLM's default: pinned host memory read through UVA); leave "
            "it out to keep them on the device where our drafter scans them on the GPU")
    return value


def parse_adaptive(method: str, value: Any, supported: bool, by_default: bool = True) -> str:
    """The `adaptive` option as "auto", "on", "batch" or "off" (ProposerSelection)."""
    if value is None:
        return "auto" if supported and by_default else "off"
    if value == BATCH_MODE and supported:
        return BATCH_MODE
    if not isinstance(value, bool):
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: {ADAPTIVE_OPTION}={value!r} must be "
            f"true, false or {BATCH_MODE!r} (true: draft lengths or tree sizes from live "
            f"acceptance and measured step costs, per request on vLLM's V1 runner; "
            f"{BATCH_MODE!r}: one length per step for the whole batch, on any runner; "
            "false verifies every draft token the proposer makes)")
    if value and not supported:
        raise ProposerConfigError(
            f"speculative_config for method {method!r}: {ADAPTIVE_OPTION}=true is not "
            "supported for this method yet (only the model-free methods adapt their "
            f"draft lengths); leave {ADAPTIVE_OPTION} out or set it to false")
    return "on" if value else "off"


# Model-free methods under async scheduling on Model Runner V2: one draft
# length per step for the whole batch with `adaptive` left unset ("auto").
# Off until a side-by-side GPU run shows it pays (issue 27): `"adaptive":
# true` turns it on (docs/results/batch_draft_length_h100_run2: no gain yet
# on the H100, trees lost at batch 1-64)
BATCH_DRAFT_LENGTH_BY_DEFAULT = False


def batch_draft_length_wanted(selection: ProposerSelection) -> bool:
    """Whether `adaptive` asks for one draft length per step on Model Runner
    V2 under async scheduling (integration/batch_schedule.py): "on" or
    "batch" for any method that adapts, "auto" where it is the default."""
    return selection.adaptive in ("on", BATCH_MODE) or (selection.adaptive == "auto"
                                                        and BATCH_DRAFT_LENGTH_BY_DEFAULT)


def check_adaptive_verification(method: str, cls, options, rest: dict[str, Any]) -> None:
    """vLLM's `enable_adaptive_verification` only where the proposer fills
    the draft confidences it reads (EAGLE-3 and MTP chains)."""
    if not rest.get(ADAPTIVE_VERIFICATION_FIELD) or cls.fills_draft_confidences(options):
        return
    raise ProposerConfigError(
        f"speculative_config for method {method!r}: {ADAPTIVE_VERIFICATION_FIELD}=true needs "
        "a chain of specplug_eagle3 or specplug_mtp (topk=1, prompt_lookup_min=0) on Model "
        "Runner V2 (CUDA); trees verify every node they keep, prompt lookups carry no "
        "head confidences, and the model-free methods choose their draft lengths with the "
        f"{ADAPTIVE_OPTION!r} option instead. Set topk=1 and prompt_lookup_min=0, or drop "
        f"{ADAPTIVE_VERIFICATION_FIELD}")


def check_tree_budget_placement(selection: ProposerSelection, num_pipeline_stages: int,
                                on_model_runner_v2: bool) -> None:
    """The tree budget (`"adaptive": true` for specplug_eagle3/specplug_mtp,
    adaptive/tree_budget.py) runs on vLLM's V1 runner, with the target on one
    rank or sharded (the first rank of the tensor-parallel group sizes every
    rank's trees, integration/first_rank.py), in one pipeline stage. On
    Model Runner V2 under async scheduling it is one tree size per step
    (integration/batch_schedule.py), which the caller checks first."""
    from vllm_specplug.proposers.eagle3 import TreeProposer

    if selection.adaptive != "on" or not issubclass(get_proposer_class(selection.method),
                                                    TreeProposer):
        return
    where = ("Model Runner V2 (CUDA)" if on_model_runner_v2 else
             f"{num_pipeline_stages} pipeline stages" if num_pipeline_stages > 1 else None)
    if where is None:
        return
    raise ProposerConfigError(
        f"speculative_config for method {selection.method!r}: {ADAPTIVE_OPTION}=true (per-step "
        f"tree sizes) runs on vLLM's V1 runner in one pipeline stage, or on Model Runner V2 "
        f"with async scheduling and vLLM's or our scheduler, not on {where}. "
        f"Drop {ADAPTIVE_OPTION}, or the scheduler_cls / async_scheduling=False that rules "
        "it out; size trees per batch with num_speculative_tokens_per_batch_size instead")


DRAFT_TP_FIELD = "draft_tensor_parallel_size"


def check_draft_tensor_parallel(method: str, rest: dict[str, Any]) -> None:
    """Our drafters run whole on every rank of a sharded target: the
    model-free ones on the host, the EAGLE-3 and MTP heads replicated (one
    decoder layer: a shard's all-reduces would cost more than its FLOPs save;
    the target's embedding is all-gathered once at load, integration/head_drafter).
    A draft sharded over ranks is refused here, before any engine starts,
    instead of being silently run replicated."""
    value = rest.get(DRAFT_TP_FIELD)
    if value is None or value == 1:
        return
    raise ProposerConfigError(
        f"speculative_config for method {method!r}: {DRAFT_TP_FIELD}={value!r} is not "
        "supported: vllm-specplug drafts whole on every rank of a tensor-parallel target "
        f"(heads replicated, draft tensor parallel size 1). Remove {DRAFT_TP_FIELD} or set it to 1")


def check_target(selection: ProposerSelection, target_hf) -> None:
    """The selected proposer's checks against the target model's config."""
    cls = get_proposer_class(selection.method)
    options = cls.options_cls.from_dict(selection.method, selection.options)
    cls.check_target(selection.method, options, target_hf)


def attach(spec_config: Any, selection: ProposerSelection) -> None:
    object.__setattr__(spec_config, SELECTION_ATTR, selection)


def selection_of(spec_config: Any) -> ProposerSelection | None:
    return getattr(spec_config, SELECTION_ATTR, None)
