"""Proposer registry: names -> proposer classes, extended by entry points.

Third parties (and our own built-ins, the same way) declare in their package:

    [project.entry-points."vllm_specplug.proposers"]
    my_method = "my_pkg.my_module:MyProposer"

and users select it with `speculative_config={"method": "my_method", ...}`.
The registry is read lazily, once per process, in every process (front end,
engine core, workers): entry points are visible wherever the package is
installed.
"""
from __future__ import annotations

import logging
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any

from vllm_specplug.proposers.base import Proposer, ProposerConfigError, ProposerOptions

logger = logging.getLogger("vllm_specplug.registry")

ENTRY_POINT_GROUP = "vllm_specplug.proposers"
# Keys of speculative_config that vLLM itself consumes for every method.
VLLM_COMMON_KEYS = frozenset({"method", "num_speculative_tokens", "enforce_eager",
                              "disable_padded_drafter_batch"})


class UnknownProposerError(ProposerConfigError):
    pass


class ShadowingProposerError(ProposerConfigError):
    pass


@lru_cache(maxsize=1)
def vllm_method_names() -> frozenset[str]:
    """Every `speculative_config.method` vLLM itself defines (its `Literal`)."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    def flatten(tp) -> list[str]:
        args = get_args(tp)
        return [tp] if not args else [name for arg in args for name in flatten(arg)]

    return frozenset(name for name in flatten(SpeculativeMethod) if isinstance(name, str))


def shadowing_message(name: str, value: str) -> str:
    return (f"entry point {ENTRY_POINT_GROUP}:{name} = {value} is refused: {name!r} is "
            "one of vLLM's own speculative methods, which keeps selecting vLLM's code; "
            f"register it under another name (e.g. 'mypkg_{name}')")


@lru_cache(maxsize=1)
def _refused() -> dict[str, str]:
    """Entry points refused because they shadow vLLM's methods: name -> why."""
    vllm_names = vllm_method_names()
    return {ep.name: shadowing_message(ep.name, ep.value)
            for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name in vllm_names}


def refused_proposers() -> dict[str, str]:
    return dict(_refused())


@lru_cache(maxsize=1)
def _entry_points() -> dict[str, Any]:
    found = {}
    for name, why in _refused().items():
        logger.error(why)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _refused():
            continue
        if ep.name in found and found[ep.name].value != ep.value:
            logger.warning("proposer %r is registered twice (%s and %s); using %s",
                           ep.name, found[ep.name].value, ep.value, found[ep.name].value)
            continue
        found[ep.name] = ep
    return found


def available_proposers() -> list[str]:
    return sorted(_entry_points())


def is_registered(name: Any) -> bool:
    return isinstance(name, str) and name in _entry_points()


@lru_cache(maxsize=None)
def get_proposer_class(name: str) -> type[Proposer]:
    if name in _refused():
        raise ShadowingProposerError(_refused()[name])
    if not is_registered(name):
        raise UnknownProposerError(
            f"unknown speculative method {name!r}; registered vllm-specplug "
            f"proposers: {available_proposers()} (vLLM's own methods are also "
            "accepted as usual)")
    cls = _entry_points()[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise ProposerConfigError(
            f"entry point {ENTRY_POINT_GROUP}:{name} = {_entry_points()[name].value} "
            "is not a vllm_specplug.proposers.Proposer subclass")
    return cls


def parse_options(name: str, raw: dict[str, Any]) -> ProposerOptions:
    """Validate the proposer-specific keys of a speculative_config."""
    return get_proposer_class(name).options_cls.from_dict(name, raw)


def refresh() -> None:
    """Forget what was read, e.g. after installing a package in a live process."""
    _entry_points.cache_clear()
    _refused.cache_clear()
    get_proposer_class.cache_clear()
