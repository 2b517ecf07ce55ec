"""One command run and watched to its end by the parent: `probe --nproc`'s launcher and `nandoctor run`'s script.

The command starts in a session of its own (its own process group: a signal to nandoctor reaches it only
when passed on). While it runs, the parent looks at every rank of a launch it may start (RankWatch) every
LOOK_SECONDS (up to QUIET_LOOK_SECONDS apart while no rank has shown itself): a rank gone without a word
is noted; when none has moved for the hang limit, or the command passed its time limit, the command's
process group and every rank (each in a session of its own) are killed. SIGINT and SIGTERM are passed on
to the command where asked, which then has the grace period (`NANDOCTOR_GRACE_SECONDS`) before its group
is killed; where not asked, they end the wait as KeyboardInterrupt does, and everything is killed first.
Nothing the command started is left running as an orphan: every rank when the launch ends, and everything
when the wait ends on an exception.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

from nandoctor.parallel.rank_progress import LOOK_SECONDS, RankWatch

# A command sent SIGINT/SIGTERM gets this long to run its own handlers (save a checkpoint, flush logs)
# before its process group is killed: `NANDOCTOR_GRACE_SECONDS` overrides it.
GRACE_SECONDS = 30.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM)
# While no rank of a launch has shown itself (a single-process script, most of `nandoctor run`), the looks
# space out, doubling up to this: each wakes the parent and preempts the script on a shared core, and 20
# looks a second cost the parent ~6.5 ms of CPU a second. A rank writes its file at its start (a second
# or more before its first step), so one is still seen within this long and looked at every LOOK_SECONDS
# from then on; the command's end wakes the wait at once (a pidfd) whatever the spacing.
QUIET_LOOK_SECONDS = 0.4


def grace_seconds() -> float:
    """Read when the first signal is passed on (a bad value fails then, as it always did)."""
    return float(os.environ.get("NANDOCTOR_GRACE_SECONDS", GRACE_SECONDS))


class Supervisor:
    """`command` started at once in a session of its own (`popen`: Popen's other arguments); `wait()` to its end.

    `watch`: the ranks of the launch the command is or may start. `time_limit`: seconds after which the
    whole command is stopped as for a hang. `kill_at_end`: the command's end ends everything it started (its
    process group and every process of the launch: the launcher ends at its first failed rank while the
    others may wait on in a collective); else only the ranks of a launch that was seen are stopped, and
    what else the command leaves behind is its own. `forward_signals`: SIGINT and SIGTERM to this process
    are passed on to the command's group during `wait()`, and `on_forward(signal, grace)` is told at the first."""

    def __init__(self, command: list[str], watch: RankWatch, *, time_limit: float | None = None,
                 kill_at_end: bool = False, forward_signals: bool = False,
                 on_forward: Callable[[int, float], None] | None = None, **popen: Any) -> None:
        self.watch = watch
        self.time_limit = time_limit
        self.kill_at_end = kill_at_end
        self.forward_signals = forward_signals
        self.on_forward = on_forward
        self.signal: int | None = None  # the first signal passed on to the command
        self.hung = False  # stopped for a hang or the time limit (after that, ranks gone are ours: no more looks)
        self.proc = subprocess.Popen(command, start_new_session=True, **popen)
        self._pidfd: int | None = None  # opened at the first look (-1: none to be had)
        self._spacing = LOOK_SECONDS  # until the next look (QUIET_LOOK_SECONDS)

    def wait(self) -> tuple[int, int | None]:
        """(the command's exit status, the signal passed on to it or None), once it ended; on an exception
        (Ctrl-C or SIGTERM where they are not passed on), everything is killed and the exception goes on."""
        try:
            with self._forwarding():
                code = self._watch()
            self._ended()  # (signals are this process's own again: one now is not the command's)
        except BaseException:  # no rank trains on as an orphan
            self.stop()
            raise
        finally:
            if self._pidfd is not None and self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = None
        return code, self.signal

    def stop(self) -> None:
        """Kill the command's process group and every process of the launch, and wait for them."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.watch.stop_all()

    def _watch(self) -> int:
        started = time.monotonic()
        while True:
            code = self._wait_a_look()
            if code is not None:
                if self.signal is None and not self.hung:
                    self.watch.look()  # a rank that died right before the launcher ended
                return code
            stalled = self.signal is None and not self.hung and self.watch.look()
            self._space_out()
            if stalled or (self.time_limit is not None and time.monotonic() - started > self.time_limit):
                self.hung = True
                self.watch.stopped()
                self.stop()

    def _space_out(self) -> None:
        """The next look's distance: LOOK_SECONDS once a rank was seen (or without a pidfd, where the command's
        end is seen only at a look), else twice the last, up to QUIET_LOOK_SECONDS."""
        if self.watch.ending.seen or self._pidfd is None or self._pidfd < 0:
            self._spacing = LOOK_SECONDS
        else:
            self._spacing = min(2 * self._spacing, QUIET_LOOK_SECONDS)

    def _wait_a_look(self) -> int | None:
        """The exit status once the command ended; None after a look's spacing. Asleep until one or the other
        (`_sleep_a_look`), not `Popen.wait(timeout)`, which polls seven times a look: over a run of the
        fast_mlp benchmark that was ~20 ms of the parent's CPU a second, 2% of the watched script's."""
        try:
            self._sleep_a_look()
            return self.proc.poll()
        except KeyboardInterrupt:  # a handler of nandoctor's raised it (the interrupt module's): pass it on
            if not self.forward_signals:
                raise
            self._forward(signal.SIGINT, None)
            return None

    def _sleep_a_look(self) -> None:
        """Until the command ends or the spacing passes: on a pidfd of the command's process (woken by its
        end), else a plain sleep (its end then seen up to a look late: `_space_out` keeps those LOOK_SECONDS)."""
        if self._pidfd is None:
            try:
                self._pidfd = os.pidfd_open(self.proc.pid)
            except (AttributeError, OSError):  # before Linux 5.3, or not Linux: no pidfd
                self._pidfd = -1
        if self._pidfd < 0:
            time.sleep(self._spacing)
        else:
            select.select([self._pidfd], [], [], self._spacing)

    def _ended(self) -> None:
        """What the command left behind (after a hang, stopped again: what is gone is not found)."""
        if self.kill_at_end:
            self.stop()
        elif self.watch.ending.seen:
            self.watch.stop_all()  # each rank runs in a session of its own: it outlives the launcher

    @contextlib.contextmanager
    def _forwarding(self) -> Iterator[None]:
        if not self.forward_signals:
            yield
            return
        previous = {sig: signal.signal(sig, self._forward) for sig in _FORWARDED}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _forward(self, signum: int, _frame: Any) -> None:
        first = self.signal is None
        self.signal = self.signal or signum
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            return
        if first:
            grace = grace_seconds()
            threading.Thread(target=self._kill_after, args=(grace,), daemon=True).start()
            if self.on_forward is not None:
                self.on_forward(signum, grace)

    def _kill_after(self, grace: float) -> None:
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
