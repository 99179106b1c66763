"""Where built models, heads, data sets and fetched assets are kept."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "VLLM_SPECPLUG_CACHE"


def default_cache_dir() -> Path:
    """`$VLLM_SPECPLUG_CACHE`, else `~/.cache/vllm_specplug`."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "vllm_specplug"
