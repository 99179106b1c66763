"""The batch policy's running decisions, from the engine core's scheduler to
the server's stat logger in the API server's process (`/metrics`).

vLLM hands the front end a `SchedulerStats` per step, with fixed fields
(serialised field by field: an attribute of ours would not cross), so the
expected tokens per request the policy priced its choice with, beside
those realised, have no way there. The scheduler writes its sums to a
small memory-mapped file instead, named by the engine's `instance_id`
(the front end's config, sent to the engine core) and its data-parallel
rank, on every step it observes; the stat logger maps it and reads it when
vLLM hands it a step's stats (integration/stat_logger.py). Each value is one aligned
float64 (written whole); a reader may see one step's sums beside the step
before's, never a torn number.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

# the values, in file order: sums since the policy started (a reset when
# the engine's policy is replaced shows as a value going down), and its
# length now
FIELDS = ("num_steps", "current", "expected_tokens", "realised_tokens", "num_requests")


def channel_path(vllm_config, engine_index: int) -> Path:
    """Where the engine `engine_index` of this server writes (RAM-backed
    /dev/shm where there is one)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(folder) / f"vllm_specplug_policy_{vllm_config.instance_id}_{engine_index}"


class PolicyChannelWriter:
    """The scheduler's side: `write` a policy's counters as of this step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # a whole new file put in place: one left by an engine before (the
        # policy replaced, or a crash) may be mapped by the stat logger, which
        # a file truncated in place would fault; it remaps the new one
        staged = path.with_name(f"{path.name}.{os.getpid()}.new")
        with open(staged, "wb") as f:
            f.write(b"\0" * (8 * len(FIELDS)))
        with open(staged, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 8 * len(FIELDS))
            self._inode = os.fstat(f.fileno()).st_ino
        os.replace(staged, path)
        self.values = np.frombuffer(self._map, dtype=np.float64)  # [len(FIELDS)]

    def write(self, stats, current: int) -> None:
        """`stats`: a `BatchDraftStats`; `current`: the length it runs."""
        v = self.values
        v[0], v[1], v[2] = stats.num_steps, current, stats.expected_tokens
        v[3], v[4] = stats.realised_tokens, stats.num_requests

    def close(self) -> None:
        del self.values
        self._map.close()
        try:  # only its own file: a writer after it may have put its own there
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass


class PolicyChannelReader:
    """The stat logger's side: the file mapped once it exists (vLLM hands the
    logger every step's stats: no open and read per step), and mapped again
    when a new writer put another in its place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None  # the mapped file, kept open to see it replaced
        self.values: np.ndarray | None = None  # [len(FIELDS)] float64, once mapped

    def read(self) -> dict[str, float] | None:
        """The last values written ({field: value}); None while no engine
        writes there (not our batch policy, or not started yet)."""
        if self._file is not None and os.fstat(self._file.fileno()).st_nlink == 0:
            self._file.close()  # unlinked or replaced: the writer's file is another
            self._file = self.values = None
        if self.values is None:
            try:
                f = open(self.path, "rb")
            except OSError:  # absent
                return None
            try:
                mapped = mmap.mmap(f.fileno(), 8 * len(FIELDS), access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # not yet its full size
                f.close()
                return None
            self._file, self.values = f, np.frombuffer(mapped, dtype=np.float64)
        return dict(zip(FIELDS, self.values.tolist()))
