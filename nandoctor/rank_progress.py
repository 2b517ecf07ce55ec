"""Where each rank of `probe --nproc` is, for the parent to name a rank that hangs or dies without a word.

A rank writes its step and phase into a 16-byte file it maps into memory: a store, no system call, so a
0.3 ms step pays nothing measurable. The parent reads every rank's file once a second. When no rank has
moved for the hang limit, the job is stopped and the rank furthest behind is named: the others are
waiting for it at a collective (DataParallel's gradient all-reduce, or the doctor's agreement). A rank
whose file says it finished or reported, and whose process died all the same, is named by the signal.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from nandoctor.findings import Phase

# `NANDOCTOR_RANK_HANG_SECONDS` overrides: long enough for a slow step or a checkpoint save of the user's
HANG_SECONDS = 600.0
_FORMAT = "<qqq"  # step, phase code, process id
_PHASES = [Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
_DONE = len(_PHASES)  # the rank left its loop: finished, or wrote a report
_CODES: dict[Phase | None, int] = {**{phase: i for i, phase in enumerate(_PHASES)}, None: _DONE}


def hang_seconds() -> float:
    return float(os.environ.get("NANDOCTOR_RANK_HANG_SECONDS", HANG_SECONDS))


def _path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.progress"


class RankProgress:
    """The writer, in a rank: `at(step, phase)` as the step moves on; `at(step, None)` when the loop ended."""

    def __init__(self, folder: Path, rank: int) -> None:
        path = _path(folder, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(struct.pack(_FORMAT, -1, 0, os.getpid()))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), struct.calcsize(_FORMAT))
        self._pid = os.getpid()  # once: a store a phase, no system call

    def at(self, step: int, phase: Phase | None) -> None:
        struct.pack_into(_FORMAT, self._map, 0, step, _CODES[phase], self._pid)


@dataclass(frozen=True)
class Position:
    step: int
    phase: Phase | None  # None: the rank left its loop
    pid: int = 0

    @property
    def alive(self) -> bool:
        return process_alive(self.pid)

    @property
    def key(self) -> tuple[int, int]:
        return (self.step, _CODES[self.phase])

    def describe(self) -> str:
        if self.step < 0:
            return "before its first step"
        if self.phase is None:
            return f"after its loop (step {self.step})"
        return f"step {self.step}, {self.phase.value}"


def process_alive(pid: int) -> bool:
    """The process still runs: gone, or a zombie its parent (the launcher) has not reaped yet, is dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: whether the process exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def read_positions(folder: Path, world: int) -> dict[int, Position]:
    """Every rank's last position (ranks that have not started yet are left out)."""
    out: dict[int, Position] = {}
    for r in range(world):
        try:
            step, code, pid = struct.unpack(_FORMAT, _path(folder, r).read_bytes()[:struct.calcsize(_FORMAT)])
        except (OSError, struct.error):
            continue
        out[r] = Position(step, None if code >= _DONE else _PHASES[code], pid)
    return out


def _log_tail(log: Path) -> str:
    """The end of a rank's log (the launcher's workerlog.N), where a dying process's last words are."""
    try:
        return log.read_text(errors="replace")[-20000:]
    except OSError:
        return ""


def signal_in_log(log: Path) -> str | None:
    """The signal Paddle's own handler printed in a rank's log before it died (SIGSEGV, SIGABRT, ...); None
    for one no process can catch (SIGKILL)."""
    found = re.findall(r"SignalInfo: \*\*\* (SIG[A-Z]+)", _log_tail(log))
    return found[-1] if found else None


def died_in_collective(log: Path) -> bool:
    """The rank's log ends in a gloo error: it died because a peer did, not first."""
    return "gloo::" in _log_tail(log)


def behind(positions: dict[int, Position]) -> list[int]:
    """The ranks furthest behind, among those still in their loop: the ones the others wait for."""
    running = {r: p for r, p in positions.items() if p.phase is not None}
    if not running:
        return []
    least = min(p.key for p in running.values())
    return sorted(r for r, p in running.items() if p.key == least)
