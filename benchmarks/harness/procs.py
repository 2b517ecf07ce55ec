"""Child processes measured from the outside: CPU time and peak RSS of each, in pairs that share a core.

Absolute times on this shared 2-core machine are noise, and so were ratios of runs made one after the
other: two runs of the same plain script, back to back, differed by up to 1.25x (also when started at
the same time on two cores: the slow spells hit one vCPU at a time). Two processes started together
*on the same core* are time-sliced by the kernel every few milliseconds, so a slow spell hits both
alike: the same plain script against itself gave CPU-time ratios of 0.997-1.007 over four such pairs,
while its absolute CPU time ranged from 7.5 to 9.8 s. So every pair here runs A and B at once on one
core and compares their CPU time (`os.wait4`: the kernel's own accounting, user + system, every
thread); when one ends first, a filler copy of it keeps the other company until it ends. Pairs run side
by side, one per core. Peak RSS comes from the same `wait4`, so nothing runs inside the child.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class ProcResult:
    """One finished child: what it cost and how it ended."""

    seconds: float
    max_rss_mb: float
    cpu_seconds: float  # user + system time of the child: far less sensitive than wall time to other load
    returncode: int
    stderr_tail: str = ""
    stdout: str = ""


@dataclass
class Paired:
    """Paired runs of two commands; `a` and `b` hold one result per pair, in order."""

    a: list[ProcResult] = field(default_factory=list)
    b: list[ProcResult] = field(default_factory=list)

    def ratios(self, measure: str) -> list[float]:
        """A over B of `measure` (a ProcResult field: cpu_seconds, seconds, max_rss_mb), one ratio per pair."""
        return [getattr(x, measure) / getattr(y, measure) for x, y in zip(self.a, self.b)]

    def medians(self, measure: str) -> tuple[float, float]:
        """The median of `measure` on each side (A's, B's), over the pairs."""
        return (statistics.median(getattr(x, measure) for x in self.a),
                statistics.median(getattr(y, measure) for y in self.b))


class _Child:
    """A child (pinned to one core when `core` is given), its output in temporary files, reaped by pid
    alone (never another's)."""

    def __init__(self, argv: list[str], core: int | None = None, quiet: bool = False,
                 cwd: Path | None = None) -> None:
        self.out = tempfile.TemporaryFile()
        self.err = tempfile.TemporaryFile()
        pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
        sink = subprocess.DEVNULL if quiet else None
        self.proc = subprocess.Popen(argv, stdout=sink or self.out, stderr=sink or self.err,
                                     stdin=subprocess.DEVNULL, preexec_fn=pin, cwd=cwd)
        self.start = time.perf_counter()
        self.result: ProcResult | None = None

    def poll(self, block: bool = False) -> ProcResult | None:
        """The child's result once it has ended (`block`: wait for that), else None."""
        if self.result is None:
            pid, status, usage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.out.seek(0)
                self.err.seek(0)
                tail = self.err.read().decode("utf-8", "replace").strip().splitlines()[-6:]
                # ru_maxrss is in kilobytes on Linux
                self.result = ProcResult(time.perf_counter() - self.start, usage.ru_maxrss / 1024.0,
                                         usage.ru_utime + usage.ru_stime, self.proc.returncode, "\n".join(tail),
                                         self.out.read().decode("utf-8", "replace"))
                self.out.close()
                self.err.close()
        return self.result

    def kill(self, grace: float = 40.0) -> None:
        """End the child as a user's Ctrl-C would: SIGTERM, then SIGKILL after `grace` seconds. A
        `nandoctor run` passes SIGTERM on to its script and removes its temporary folder (30 s grace of its
        own); killed outright, it left the folder behind and its script running on the core, orphaned,
        beside the next pair."""
        if self.poll() is None:
            self.proc.terminate()
            end = time.perf_counter() + grace
            while self.poll() is None:
                if time.perf_counter() > end:
                    self.proc.kill()
                time.sleep(0.01)


def run_timed(argv: list[str], *, timeout: float = 1200.0, cwd: Path | None = None,
              core: int | None = None) -> ProcResult:
    """Run `argv` to the end (pinned to `core` when given); wall seconds from spawn to reap, peak RSS of that
    child alone (wait4)."""
    child = _Child(argv, core, cwd=cwd)
    # A hung child must not hang the whole benchmark: kill only this child, by its own pid.
    timer = threading.Timer(timeout, child.proc.kill)
    timer.start()
    try:
        return child.poll(block=True)  # type: ignore[return-value]
    finally:
        timer.cancel()


def _tagged(argv: list[str], tag: str) -> list[str]:
    return [x.replace("{run}", tag) for x in argv]


def run_on_one_core(a: list[str], b: list[str], core: int | None, tag: str = "0", *,
                    timeout: float = 1200.0) -> tuple[ProcResult, ProcResult]:
    """A and B started together on `core`; whichever ends first is replaced by a filler copy of itself
    (output discarded) until the other ends, so neither runs its last stretch alone on the core.
    `{run}` in an argument becomes `tag` (`tag-filler` for fillers): runs side by side write apart."""
    children = {"a": _Child(_tagged(a, tag), core), "b": _Child(_tagged(b, tag), core)}
    argv = {"a": _tagged(a, f"{tag}-filler"), "b": _tagged(b, f"{tag}-filler")}
    fillers: list[_Child] = []
    deadline = time.perf_counter() + timeout
    try:
        while any(c.poll() is None for c in children.values()):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"benchmark child ran over {timeout:.0f} s: {' '.join(a)}")
            done = [k for k, c in children.items() if c.result is not None]
            if len(done) == 1 and (not fillers or fillers[-1].poll() is not None):
                fillers.append(_Child(argv[done[0]], core, quiet=True))
            time.sleep(0.01)
    finally:
        for child in [*children.values(), *fillers]:
            child.kill()
    return children["a"].result, children["b"].result  # type: ignore[return-value]


def cores() -> list[int | None]:
    """The cores this process may use (pairs run side by side, one per core); [None] where a process
    cannot be pinned (no `sched_getaffinity`: not Linux), and then pairs run one at a time, unpinned."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [None]


def run_paired(a: list[str], b: list[str], runs: int, *, timeout: float = 1200.0) -> Paired:
    """`runs` pairs, each A and B at once on one core (`run_on_one_core`), as many pairs at a time as
    there are cores. `{run}` in an argument becomes the pair's number, so that pairs running side by
    side write different files."""
    slots = cores()
    return _pairs(lambda i: run_on_one_core(a, b, slots[i % len(slots)], str(i), timeout=timeout), runs, slots)


def run_alone(a: list[str], b: list[str], runs: int, *, timeout: float = 1200.0, tag: str = "") -> Paired:
    """`runs` pairs, each A and B one after the other, alone on one core (B first on every other pair), as
    many pairs at a time as there are cores: each process has its core to itself, as a user's training has.

    The shared core of `run_paired` cancels slow spells, but it is not free: each process's caches are
    cold again after every time slice of the other, which adds CPU time to both sides alike and so pulls
    their ratio towards 1. On fast_mlp (20,000 steps of 0.4 ms, 5 December) the plain script took 8.8-9.0 s
    of CPU alone and 11.2-13.9 s beside `nandoctor run`; `run` was 1.22-1.30x the script alone and 1.13-1.17x
    on a shared core. This is the user's view; its pairs are noisier (spells hit one side), so both are reported.
    `{run}` becomes `tag` and the pair's number."""
    slots = cores()

    def one(i: int) -> tuple[ProcResult, ProcResult]:
        core = slots[i % len(slots)]
        first, second = (a, b) if i % 2 == 0 else (b, a)
        r1 = run_timed(_tagged(first, f"{tag}{i}"), timeout=timeout, core=core)
        r2 = run_timed(_tagged(second, f"{tag}{i}"), timeout=timeout, core=core)
        return (r1, r2) if i % 2 == 0 else (r2, r1)

    return _pairs(one, runs, slots)


def _pairs(one: Callable[[int], tuple[ProcResult, ProcResult]], runs: int, slots: list[int | None]) -> Paired:
    """`one(i)` for each pair, as many at a time as there are cores, collected in pair order."""
    paired = Paired()
    with ThreadPoolExecutor(max_workers=len(slots)) as pool:
        for ra, rb in pool.map(one, range(runs)):
            paired.a.append(ra)
            paired.b.append(rb)
    return paired


RESULT_PREFIX = "BENCH_RESULT "


def run_worker(argv: list[str], *, timeout: float = 1800.0) -> dict:
    """Run an in-process measurement in its own child and read the JSON line it prints last.

    A fresh process per measurement keeps one workload's allocations and hooks from touching the next.
    """
    res = run_timed(argv, timeout=timeout)
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    why = res.stderr_tail.splitlines()[-1] if res.stderr_tail else f"exit status {res.returncode}"
    return {"error": why}
