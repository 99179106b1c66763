"""Helpers of tests/test_bad_input.py: small datasets, ways to damage them, a tmpfs."""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from vllm_specplug.extraction import dataset as ds
from vllm_specplug.extraction import errors

SHARDS = [[3, 4], [5], [2, 6]]      # samples s0 s1 | s2 | s3 s4; manifest lines 1..5
DAMAGED = "shards/shard-00001.safetensors"


SMALL = ds.DatasetInfo("m", [1, 2], 4, "float32", 3)
TINY = ds.DatasetInfo("tiny", [2, 3, 4, 6], 128, "float32", 6)   # the built-in target


def sample(number: int, num_tokens: int, info: ds.DatasetInfo = SMALL,
           seed: int = 0) -> ds.Sample:
    gen = torch.Generator().manual_seed(seed * 1000 + number)
    mask = torch.ones(num_tokens, dtype=torch.uint8)
    mask[:num_tokens // 3] = 0
    return ds.Sample(f"s{number}", number + 1,
                     torch.randint(3, 4096, (num_tokens,), generator=gen),
                     torch.randn(num_tokens, len(info.layer_ids), info.hidden_size,
                                 generator=gen), mask)


def small_dataset(root: Path, shards=SHARDS, info: ds.DatasetInfo = SMALL
                  ) -> dict[str, ds.Sample]:
    """Shards of samples s0, s1, ... (sizes per shard), manifest lines 1, 2, ..."""
    root.mkdir(parents=True, exist_ok=True)
    info.save(root)
    samples: dict[str, ds.Sample] = {}
    for index, sizes in enumerate(shards):
        batch = [sample(len(samples) + j, n, info) for j, n in enumerate(sizes)]
        ds.write_shard(root, index, batch)
        samples.update({s.sample_id: s for s in batch})
    return samples


def same_samples(dataset, samples: dict) -> bool:
    return all(torch.equal(item[key], getattr(samples[item["sample_id"]], key))
               for item in dataset for key in ds.KEYS)


def _edit_manifest_line(root: Path, number: int, text: str) -> None:
    path = root / ds.MANIFEST_FILE
    lines = path.read_text().splitlines(keepends=True)
    lines[number - 1] = text + "\n"
    path.write_text("".join(lines))


def _line(root: Path, number: int) -> dict:
    return json.loads((root / ds.MANIFEST_FILE).read_text().splitlines()[number - 1])


def _rewrite_shard(root: Path, edit) -> None:
    path = root / DAMAGED
    path.write_bytes(edit(path.read_bytes()))


def _garbage_header(data: bytes) -> bytes:
    length = int.from_bytes(data[:8], "little")
    return data[:8] + b"x" * length + data[8 + length:]


# kind: (damage, error class, message fragments); each costs sample s2 only
DAMAGES = {
    "shard cut to half": (
        lambda r: _rewrite_shard(r, lambda d: d[:len(d) // 2]),
        errors.ShardError, [DAMAGED, "cut short"]),
    "shard of random bytes": (
        lambda r: _rewrite_shard(r, lambda d: random.Random(0).randbytes(len(d))),
        errors.ShardError, [DAMAGED, "not a safetensors file"]),
    "shard header overwritten": (
        lambda r: _rewrite_shard(r, _garbage_header),
        errors.ShardError, [DAMAGED, "header is not JSON"]),
    "shard with bytes appended": (
        lambda r: _rewrite_shard(r, lambda d: d + b"\0" * 64),
        errors.ShardError, [DAMAGED, "bytes appended"]),
    "shard missing": (
        lambda r: (r / DAMAGED).unlink(),
        errors.ShardError, [f"{DAMAGED}: missing", "manifest.jsonl:3"]),
    "manifest line not JSON": (
        lambda r: _edit_manifest_line(r, 3, '{"sample_id": "s2", "sour'),
        errors.ManifestError, ["manifest.jsonl:3", "corrupt manifest line"]),
    "manifest line past its shard": (
        lambda r: _edit_manifest_line(r, 3, json.dumps({**_line(r, 3), "offset": 1})),
        errors.ManifestError, ["manifest.jsonl:3", "past the end of"]),
    "manifest line with too many tokens": (
        lambda r: _edit_manifest_line(r, 3, json.dumps({**_line(r, 3),
                                                        "num_tokens": 50})),
        errors.ManifestError, ["manifest.jsonl:3", "past the end of"]),
    "manifest line of invalid UTF-8": (
        lambda r: (r / ds.MANIFEST_FILE).write_bytes(
            (r / ds.MANIFEST_FILE).read_bytes().replace(b'"s2"', b'"s\xff"')),
        errors.ManifestError, ["manifest.jsonl:3", "can't decode byte 0xff"]),
    "manifest line naming a file outside": (
        lambda r: _edit_manifest_line(r, 3, json.dumps({**_line(r, 3),
                                                        "shard": "../x.safetensors"})),
        errors.ManifestError, ["manifest.jsonl:3", "is not shards/NAME.safetensors"]),
}


class Tmpfs:
    """A size-limited tmpfs at `path` (root only): a real full disk."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mount(self, size: int) -> subprocess.CompletedProcess:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(self.path)], capture_output=True, text=True)

    def remount(self, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(self.path)],
                       check=True, capture_output=True)

    def resize(self, size: int) -> None:
        self.remount(f"size={size}")

    def fill(self, leave: int = 0) -> Path:
        """Take every free byte but `leave`, in a file: delete it to free them."""
        filler = self.path / "filler"
        with open(filler, "wb", buffering=0) as handle:
            try:
                while True:
                    handle.write(b"\0" * 4096)
            except OSError:
                pass
            handle.truncate(max(0, handle.tell() - leave))
        return filler

    def unmount(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def disk_bytes(directory: Path) -> int:
    """Bytes the files under `directory` take on a tmpfs (whole pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096
               for p in Path(directory).rglob("*") if p.is_file())


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 kB tmpfs (`.resize()` it). Not root: skipped (CI runs as root);
    as root a failed mount fails the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    fs = Tmpfs(tmp_path / "tmpfs")
    fs.path.mkdir()
    result = fs.mount(64 * 1024)
    assert result.returncode == 0, f"cannot mount a tmpfs as root: {result.stderr.strip()}"
    yield fs
    fs.unmount()
