"""Ctrl-C and SIGTERM: both become KeyboardInterrupt (SIGTERM as its subclass `Terminated`), so every
`except KeyboardInterrupt` that ends a run early with a partial report handles timeouts, Slurm and CI
cancels too; the signal received decides the exit status (128 + its number: 130, 143).

Paddle installs C++ handlers at import that dump a native stack on SIGTERM; `install()` runs after
Paddle is imported and puts Python's handlers back. The user's own imports can do the same behind
Python's back (`import paddleformers` resets SIGTERM to the default in C while `signal.getsignal` still
shows ours): `reassert()` runs after the user's code is imported, the model built and the loader made.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from nandoctor.findings import Code, Finding, Location, Phase, Severity

_received: int | None = None


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop as for Ctrl-C, exit 143."""


def _on_sigint(signum: int, frame: Any) -> None:
    global _received
    _received = signum
    raise KeyboardInterrupt


def _on_sigterm(signum: int, frame: Any) -> None:
    global _received
    _received = signum
    raise Terminated


def install() -> None:
    """Python handlers for SIGINT and SIGTERM (again after `import paddle`); main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _on_sigint)
    signal.signal(signal.SIGTERM, _on_sigterm)


def reassert() -> None:
    """Re-set the SIGINT/SIGTERM handlers Python believes are installed, so that the C-level disposition
    matches them again after a library changed it underneath (two system calls; main thread only).
    Only Python-level handlers are re-set: a default or a C handler Python does not know is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if callable(handler):
            signal.signal(signum, handler)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGINT and SIGTERM handled as above for the duration of one command; the previous handlers after."""
    global _received
    _received = None
    main = threading.current_thread() is threading.main_thread()
    previous = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) if main else None
    install()
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous[0])
            signal.signal(signal.SIGTERM, previous[1])


def received() -> int | None:
    """The signal that interrupted this run, if any."""
    return _received


def exit_status(exc: BaseException | None = None) -> int:
    """130 for SIGINT, 143 for SIGTERM (128 + the signal's number, as shells report it)."""
    if _received is not None:
        return 128 + _received
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


def name(exc: BaseException | None = None, signum: int | None = None) -> str:
    signum = signum or _received or (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    return "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C (SIGINT)"


def interrupted_finding(command: str, done: str, *, step: int | None = None, batch_index: int | None = None,
                        phase: Phase | None = None, signum: int | None = None) -> Finding:
    """The info finding of a partial report: what stopped it (`signum`, else the one this process got) and
    what the findings cover."""
    what = name(signum=signum)
    return Finding(
        Code.RUN_INTERRUPTED, Severity.INFO,
        f"The {command} was stopped by {what} after {done}; the report is partial and its findings cover "
        "only what ran. Run it again without interrupting for a full diagnosis.",
        Location(step=step, batch_index=batch_index, phase=phase), {"signal": what, "done": done},
        ["Run the script again without interrupting it: nandoctor run stops it itself at the first fault."]
        if command == "nandoctor run" else
        ["Give the run more time (--steps/--batches bound its length) or interrupt later."])


def stop_loader(it: Any) -> None:
    """Stop a DataLoader iterator's worker processes now (after an interrupt too), not whenever the GC
    runs; anything else (a list iterator, a generator) needs nothing."""
    shutdown = getattr(it, "_try_shutdown_all", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - the workers are already gone
            pass
