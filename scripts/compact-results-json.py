"""Rewrite the tracked JSON files under docs/results without whitespace.

Every GPU call carries the tracked tree, and what is left of its 64 MiB
carries the staged site (docs/gpu.md). docs/results' JSON files, written
indented by `bench` and the benchmarks, were 16.1 MB of the 38.5 MB tree on
2026-12-05; compact they are 10.4 MB. The values stay exactly as they were
(each file is read back and compared before it is replaced), so every
reader and link is unchanged.

Usage, from the project root:  .venv/bin/python scripts/compact-results-json.py [PATH ...]
(no PATH: every tracked docs/results/**/*.json). Prints the bytes saved.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def compact(path: Path) -> int:
    """Rewrite `path` compact if that changes its bytes and not its values;
    the bytes saved."""
    raw = path.read_bytes()
    value = json.loads(raw)
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False) + "\n"
    if json.loads(text) != value:
        raise SystemExit(f"{path}: its compact form reads back differently; left as it is")
    new = text.encode()
    if len(new) >= len(raw):
        return 0
    path.write_bytes(new)
    return len(raw) - len(new)


def tracked_results() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "docs/results"], check=True,
                            capture_output=True, text=True).stdout.split("\0")
    return [Path(p) for p in listed if p.endswith(".json")]


def main(argv: list[str]) -> None:
    paths = [Path(p) for p in argv] or tracked_results()
    saved = sum(compact(p) for p in paths)
    print(f"{len(paths)} JSON files, {saved} bytes saved")


if __name__ == "__main__":
    main(sys.argv[1:])
