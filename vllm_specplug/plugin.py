"""Entry point of the `vllm.general_plugins` group.

vLLM calls `register()` once in every process it starts (API server, engine
core, workers) and only *logs* an exception from it, so this module records its
outcome in `registration_state()` where tests and `vllm-specplug check` can read
it from inside any of those processes.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import asdict, dataclass, field

from vllm_specplug.version_gate import check_vllm_version

logger = logging.getLogger("vllm_specplug")

# "module:function" registrars run in order; each returns the names it added.
REGISTRARS: tuple[str, ...] = (
    "vllm_specplug.patches.install:register_proposers",
    "vllm_specplug.extraction.registrar:register_connectors",
)


@dataclass
class RegistrationState:
    registered: bool = False
    pid: int | None = None
    vllm_version: str | None = None
    items: list[str] = field(default_factory=list)
    error: str | None = None


_STATE = RegistrationState()


def registration_state() -> dict:
    """What `register()` did in this process, as a plain dict."""
    return asdict(_STATE)


def _run_registrars() -> list[str]:
    items: list[str] = []
    for spec in REGISTRARS:
        module_name, func_name = spec.split(":")
        items += getattr(importlib.import_module(module_name), func_name)()
    return items


def register() -> None:
    """Idempotent: a second call in the same process does nothing."""
    if _STATE.registered:
        return
    try:
        _STATE.vllm_version = str(check_vllm_version())
        _STATE.items = _run_registrars()
    except Exception as exc:
        _STATE.error = f"{type(exc).__name__}: {exc}"
        logger.error("vllm-specplug failed to register: %s", _STATE.error)
        raise
    _STATE.registered = True
    _STATE.pid = os.getpid()
    logger.info("vllm-specplug registered with vLLM %s (pid %d): %s",
                _STATE.vllm_version, _STATE.pid,
                ", ".join(_STATE.items) or "no extensions yet")
