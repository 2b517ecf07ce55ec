"""Where the snapshot ring's copies live: host memory within a budget, then a temporary folder on disk.

A snapshot of a large model (weights and Adam's two moments: ~12 bytes a parameter) costs as much host
memory as the training itself. Snapshots therefore stay in memory only while together they hold at most
`MEMORY_BYTES`, and never more than `MEMORY_SHARE` of the memory available when the run starts
(`MemAvailable` in /proc/meminfo). The others are written, tensor by
tensor, as `.npy` files into one temporary folder (`tempfile`, so `TMPDIR` chooses the disk), within
`DISK_SHARE` of that disk's free space; read back tensor by tensor too, so restoring one never holds a
second copy of the model. The folder goes when the ring is closed, when the process exits, and with it
on Ctrl-C or SIGTERM (both unwind as KeyboardInterrupt, interrupt.py). Two environment variables set the
budgets in MB instead (tests, or a machine where the defaults do not suit): `NANDOCTOR_SNAPSHOT_MEMORY_MB`
and `NANDOCTOR_SNAPSHOT_DISK_MB`; 0 means none there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

MEMORY_BYTES = 256 * 2**20  # in-memory snapshots together
MEMORY_SHARE = 0.25  # ...and never more than this share of the memory available at the start
DISK_SHARE = 0.5  # spilled snapshots together: at most this share of the spill disk's free space
MEMORY_ENV = "NANDOCTOR_SNAPSHOT_MEMORY_MB"
DISK_ENV = "NANDOCTOR_SNAPSHOT_DISK_MB"


def memory_available() -> int | None:
    """Bytes of host memory available without swapping (/proc/meminfo MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _env_mb(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return max(0, int(float(raw) * 2**20))
    except ValueError:
        return None  # a malformed setting: the default (the setting is ours, not the user's training)


@dataclass
class Budget:
    memory: int
    disk: int

    @classmethod
    def now(cls) -> Budget:
        memory = _env_mb(MEMORY_ENV)
        if memory is None:
            avail = memory_available()
            memory = MEMORY_BYTES
            if avail is not None:
                memory = min(memory, int(MEMORY_SHARE * avail))
        disk = _env_mb(DISK_ENV)
        if disk is None:
            try:
                disk = int(DISK_SHARE * shutil.disk_usage(tempfile.gettempdir()).free)
            except OSError:
                disk = 0
        return cls(memory, disk)

    def text(self) -> str:
        return f"{self.memory / 2**20:.0f} MB in memory, {self.disk / 2**20:.0f} MB on disk"


class Spilled(Mapping[str, np.ndarray]):
    """Arrays saved as .npy files: each one read when it is asked for, so a restore holds one at a time."""

    def __init__(self, paths: dict[str, str], keep: Any = None) -> None:
        self.paths = paths
        self._keep = keep  # the mapping whose lifetime decides when the snapshot's folder goes

    def __getitem__(self, key: str) -> np.ndarray:
        return np.load(self.paths[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


class SpillFolder:
    """The ring's one temporary folder, made on the first spill and removed by `close()` or at exit."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._count = 0
        self._finalizer: Any = None

    def new_dir(self) -> str:
        """A fresh subfolder for one snapshot (removed with the snapshot, see `forget_with`)."""
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="nandoctor-snapshots-")
            # at interpreter exit too (atexit runs finalizers), and when the ring is collected
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)
        self._count += 1
        sub = os.path.join(self.path, f"s{self._count}")
        os.mkdir(sub)
        return sub

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.path = None


def forget_with(owner: Any, folder: str) -> None:
    """Remove `folder` when `owner` (a snapshot) is dropped: an evicted snapshot frees its disk space."""
    weakref.finalize(owner, shutil.rmtree, folder, True)


def save(folder: str, arr: np.ndarray, n: int) -> str:
    path = os.path.join(folder, f"{n}.npy")
    np.save(path, arr, allow_pickle=False)
    return path
