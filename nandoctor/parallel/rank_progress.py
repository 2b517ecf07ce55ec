"""Where each rank of a launch is, for the parent to name a rank that hangs or dies without a word.

A rank writes its step and phase into a small file it maps into memory: a store, no system call, so a
0.3 ms step pays nothing measurable. Two parents read them through one supervisor (supervisor.py;
`RankWatch` every 50 ms): `probe --nproc`, whose ranks run nandoctor's own loop and mark every phase,
and `nandoctor run` over the user's own `paddle.distributed.launch`, whose ranks start their writer with
the process (the parent's `NANDOCTOR_RANK_PROGRESS` names the folder) and are moved on by the ranks'
agreement at each check (distributed.py) and by hooks on the model (`follow`: its forward, and the
backward back to its outputs). A rank whose process is gone while its loop ran died without a word; when
no rank has moved for the hang limit, the job is stopped and the rank furthest behind is named: the others
are waiting for it at a collective (DataParallel's gradient all-reduce, or the doctor's agreement).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import mmap
import os
import re
import signal
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nandoctor.findings import Phase

# `NANDOCTOR_RANK_HANG_SECONDS` overrides: long enough for a slow step or a checkpoint save of the user's
HANG_SECONDS = 600.0
LOOK_SECONDS = 0.05  # between two looks at the ranks: a killed rank is told from one that aborted after it
ENV = "NANDOCTOR_RANK_PROGRESS"  # the folder a launched rank writes to, set by the parent that reads it
_FORMAT = "<qqq"  # step, phase code, process id
_SIZE = struct.calcsize(_FORMAT)
_PHASES = [Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
_DONE = len(_PHASES)  # the rank left its loop: finished, or wrote a report
_CODES: dict[Phase | None, int] = {**{phase: i for i, phase in enumerate(_PHASES)}, None: _DONE}


def hang_seconds() -> float:
    return float(os.environ.get("NANDOCTOR_RANK_HANG_SECONDS", HANG_SECONDS))


def _path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.progress"


def _info_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.json"


# ---- the rank's side -------------------------------------------------------------------------------------
class RankProgress:
    """The writer, in a rank: `at(step, phase)` as the step moves on; `at(step, None)` when the loop ended.
    Beside the mapped file, what the parent cannot see from outside: the job's size and this rank's log
    (the launcher's workerlog.N, where a dying process's last words are)."""

    def __init__(self, folder: Path, rank: int) -> None:
        path = _path(folder, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        log_dir = os.environ.get("PADDLE_LOG_DIR")
        local_rank = os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", str(rank)))
        info = {"pid": os.getpid(), "world": _int_env("PADDLE_TRAINERS_NUM"),
                "local_size": _int_env("PADDLE_LOCAL_SIZE"),
                "log": str(Path(log_dir) / f"workerlog.{local_rank}") if log_dir else None}
        _info_path(folder, rank).write_text(json.dumps(info), encoding="utf-8")
        path.write_bytes(struct.pack(_FORMAT, -1, 0, os.getpid()))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _SIZE)
        self._pid = os.getpid()  # once: a store a phase, no system call
        self.step = -1
        self.own_loop = False  # a loop of nandoctor's own marks every phase (probe --nproc): none to follow
        os.register_at_fork(after_in_child=self._forked)

    def at(self, step: int, phase: Phase | None) -> None:
        self.step = step
        struct.pack_into(_FORMAT, self._map, 0, step, _CODES[phase], self._pid)

    def left(self) -> None:
        """The process ends on its own (the script finished, raised, or stopped at a fault): not a death."""
        self.at(self.step, None)

    def _forked(self) -> None:
        """A process the rank forks (a DataLoader worker) shares the mapping: it must not move the rank."""
        self.at = _nowhere  # type: ignore[method-assign]

    def follow(self, model: Any, step_of: Callable[[], int]) -> None:
        """`nandoctor run`: the model's training-mode forward, and the backward's first gradient back to its
        outputs, move this rank on (its check comes from the agreement). Hooks, on the script's own model."""
        from nandoctor.tensors.convert import leaves

        def forward(layer: Any, _inputs: Any) -> None:
            if layer.training:
                self.at(step_of(), Phase.FORWARD)

        def backward(_grad: Any) -> None:
            self.at(step_of(), Phase.BACKWARD)

        def output(layer: Any, _inputs: Any, out: Any) -> None:
            if layer.training:
                leaf = next((t for t in leaves(out) if not t.stop_gradient), None)
                if leaf is not None:
                    leaf.register_hook(backward)

        model.register_forward_pre_hook(forward)
        model.register_forward_post_hook(output)


def _nowhere(_step: int, _phase: Phase | None) -> None:
    return None


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


_LAUNCHED: list[RankProgress | None] = []  # this process's writer, looked for once


def launched_rank() -> RankProgress | None:
    """This process's writer when it is a rank of a launch whose parent watches the ranks (`ENV` and the
    launcher's PADDLE_TRAINER_ID set): started at the rank's start, so a rank that dies or hangs before its
    first step is seen too; None elsewhere. A process the rank starts itself inherits both variables: it
    finds the rank's file held by a live process and writes nothing."""
    if _LAUNCHED:
        return _LAUNCHED[0]
    writer = None
    folder, rank = os.environ.get(ENV), os.environ.get("PADDLE_TRAINER_ID")
    if folder and rank and rank.isdigit() and Path(folder).is_dir():  # (not a variable leaked from a run gone)
        held = read_positions(Path(folder)).get(int(rank))
        if held is None or not held.alive:
            try:
                writer = RankProgress(Path(folder), int(rank))
                atexit.register(writer.left)  # (not at SIGKILL, nor at a native crash: those are deaths)
            except OSError:  # the parent's folder is gone: nothing reads it any more
                writer = None
    _LAUNCHED.append(writer)
    return writer


# ---- the parent's side -----------------------------------------------------------------------------------
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
        """Where it stood, as `details.ranks` puts it ("step 3, forward")."""
        if self.step < 0:  # (under `nandoctor run` the first position comes with the first step's check)
            return "before its first checked step"
        if self.phase is None:
            return f"after its loop (step {self.step})"
        return f"step {self.step}, {self.phase.value}"

    def said(self) -> str:
        """The same inside a sentence ("at step 3, forward", "before its first checked step")."""
        return self.describe() if self.step < 0 or self.phase is None else f"at {self.describe()}"


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


def read_positions(folder: Path) -> dict[int, Position]:
    """Every rank's last position (ranks that have not started yet are left out)."""
    out: dict[int, Position] = {}
    for path in Path(folder).glob("rank-*.progress"):
        try:
            rank = int(path.name[len("rank-"):-len(".progress")])
            step, code, pid = struct.unpack(_FORMAT, path.read_bytes()[:_SIZE])
        except (OSError, ValueError, struct.error):
            continue
        out[rank] = Position(step, None if code >= _DONE else _PHASES[code], pid)
    return out


def _read_info(folder: Path, rank: int) -> dict[str, Any]:
    try:
        return json.loads(_info_path(folder, rank).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _log_tail(log: Path | None) -> str:
    """The end of a rank's log (the launcher's workerlog.N), where a dying process's last words are."""
    if log is None:
        return ""
    try:
        return log.read_text(errors="replace")[-20000:]
    except OSError:
        return ""


def signal_in_log(log: Path | None) -> str | None:
    """The signal Paddle's own handler printed in a rank's log before it died (SIGSEGV, SIGABRT, ...); None
    for one no process can catch (SIGKILL)."""
    found = re.findall(r"SignalInfo: \*\*\* (SIG[A-Z]+)", _log_tail(log))
    return found[-1] if found else None


def died_in_collective(log: Path | None) -> bool:
    """The rank's log ends in a gloo error: it died because a peer did (or stopped answering), not first."""
    return "gloo::" in _log_tail(log)


def behind(positions: dict[int, Position]) -> list[int]:
    """The ranks furthest behind, among those still in their loop: the ones the others wait for."""
    running = {r: p for r, p in positions.items() if p.phase is not None}
    if not running:
        return []
    least = min(p.key for p in running.values())
    return sorted(r for r, p in running.items() if p.key == least)


@dataclass
class Ending:
    """How a launch ended, as the parent saw it: ranks that vanished mid-loop in the order they did (those
    whose log ends in a collective's error among them), where every rank stood, and `hung` when the parent
    stopped a launch in which none moved for the limit."""

    world: int
    died: list[int] = field(default_factory=list)
    in_collective: set[int] = field(default_factory=set)
    positions: dict[int, Position] = field(default_factory=dict)
    logs: dict[int, Path | None] = field(default_factory=dict)
    hung: bool = False

    @property
    def seen(self) -> bool:
        """Ranks were watched at all (a launch under `nandoctor run`, not a single process)."""
        return bool(self.positions)

    @property
    def all_exited(self) -> bool:
        """Under `nandoctor run`: every rank of the job got through its whole Python exit (its script, its
        report, then every atexit handler, Paddle's too: `launched_rank`'s mark is registered first, so it
        runs last), none died mid-loop and none hung. What kills such a rank after that is the interpreter's
        own finalisation (Paddle's C++ teardown), not the training (docs/paddle-teardown.md)."""
        world = max(self.world, len(self.positions))
        return (self.seen and not self.died and not self.hung and len(self.positions) >= world
                and all(p.phase is None for p in self.positions.values()))


class RankWatch:
    """The parent's look at every rank of one launch; `look()` every LOOK_SECONDS while it runs.

    `whole_loop`: the ranks mark every phase to the end of their loop (the probe's own loop), so ranks that
    all stand still at one same place are hung too. Under `nandoctor run` only the model's forward, its
    backward and the check are seen: ranks standing together may be doing the script's own work between
    steps (an evaluation, a checkpoint save), so a hang is judged only when some rank is ahead of another
    (waiting for it at a collective)."""

    def __init__(self, folder: Path, world: int | None = None, *, whole_loop: bool = True) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)  # (a rank writes only into a folder its parent made)
        self.ending = Ending(world or 0)
        self.local = world  # the ranks on this machine, once known: a hang is judged when all have started
        self.whole_loop = whole_loop
        self.limit = hang_seconds()
        self.last_move = time.monotonic()
        self._infos: dict[int, dict[str, Any]] = {}

    def look(self) -> bool:
        """One look: note the ranks gone mid-loop; True when none moved for the hang limit."""
        now = time.monotonic()
        ending = self.ending
        positions = read_positions(self.folder)
        for r in positions:
            if r not in self._infos or self._infos[r].get("pid") != positions[r].pid:
                info = self._infos[r] = _read_info(self.folder, r)
                ending.world = max(ending.world, int(info.get("world") or 0), r + 1)
                self.local = self.local or info.get("local_size")
                ending.logs[r] = Path(info["log"]) if info.get("log") else None
        gone = [r for r, where in positions.items()
                if where.phase is not None and r not in ending.died and not where.alive]
        # a rank whose peer died aborts in gloo within milliseconds ("Connection reset by peer"): of the
        # ranks gone since the last look, those that died of a collective go after the one that did not
        collective = {r for r in gone if died_in_collective(ending.logs.get(r))}
        ending.died += sorted(gone, key=lambda r: r in collective)
        ending.in_collective |= collective
        if positions != ending.positions:
            ending.positions, self.last_move = positions, now
        return now - self.last_move > self.limit and self._judged(positions)

    def _judged(self, positions: dict[int, Position]) -> bool:
        """A stall is a hang once every rank of this machine has started and one has begun its steps (start-up
        on a loaded machine can be slow) and, unless the whole loop is seen, when one rank is ahead of another."""
        if len(positions) < (self.local or self.ending.world or len(positions) + 1):
            return False
        running = [p.key for p in positions.values() if p.phase is not None]
        if not any(p.step >= 0 for p in positions.values()) or not running:
            return False
        return self.whole_loop or len(set(running)) > 1

    def stopped(self) -> None:
        """The parent stopped the launch for a hang (not after a death it saw)."""
        self.ending.hung = not self.ending.died

    def stop_all(self, grace: float = 5.0) -> None:
        """Kill every process of the launch still running: the launcher starts each rank in a session of its
        own, so they outlive it (a rank blocked in a collective trains on as an orphan). They are found by
        `ENV`, which every rank and every process a rank started inherits; wait until they are gone."""
        deadline = time.monotonic() + grace
        while (left := processes_with(ENV, str(self.folder))) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def processes_with(variable: str, value: str) -> list[int]:
    """Live processes (not this one) started with `variable=value` in their environment, or inheriting it
    (Linux /proc; elsewhere none are found)."""
    found = []
    needle = f"\0{variable}={value}\0".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        if entry.name == str(os.getpid()):
            continue
        try:
            if needle not in b"\0" + (entry / "environ").read_bytes() + b"\0":
                continue
        except OSError:  # gone, or another user's
            continue
        if process_alive(int(entry.name)):
            found.append(int(entry.name))
    return found
