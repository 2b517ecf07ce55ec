"""Child processes timed from the outside: wall time and peak RSS of each, in paired alternating runs.

Absolute times on a shared 2-core machine are noise; the ratio of two runs made back to back is not, so
every comparison here runs A and B alternately (A B A B ...) and keeps the per-pair ratios. Peak RSS
comes from `os.wait4`, the kernel's own accounting of the child, so nothing runs inside the child.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


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
    """Alternating runs of two commands; `a` and `b` hold one result per run, in order."""

    a: list[ProcResult] = field(default_factory=list)
    b: list[ProcResult] = field(default_factory=list)


def run_timed(argv: list[str], *, timeout: float = 1200.0, cwd: Path | None = None) -> ProcResult:
    """Run `argv` to the end; wall seconds from spawn to reap, peak RSS of that child alone (wait4)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd)
        # A hung child must not hang the whole benchmark: kill only this child, by its own pid.
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        tail = err.read().decode("utf-8", "replace").strip().splitlines()[-6:]
    # ru_maxrss is in kilobytes on Linux
    return ProcResult(seconds, usage.ru_maxrss / 1024.0, usage.ru_utime + usage.ru_stime, proc.returncode,
                      "\n".join(tail), stdout)


def run_paired(a: list[str], b: list[str], runs: int, *, timeout: float = 1200.0) -> Paired:
    """`runs` pairs in A B B A order (pair 2 runs B first), so neither side always runs first and slow
    drift in the machine hits both sides alike."""
    paired = Paired()
    for i in range(runs):
        if i % 2 == 0:
            paired.a.append(run_timed(a, timeout=timeout))
            paired.b.append(run_timed(b, timeout=timeout))
        else:
            paired.b.append(run_timed(b, timeout=timeout))
            paired.a.append(run_timed(a, timeout=timeout))
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
