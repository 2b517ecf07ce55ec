"""Keep the user's libraries' INFO/WARNING log lines out of the terminal and the report, but keep them.

Model zoos and tokenizers log chatty lines while a model is built and trained ("loading weights",
"using default config"); printed between nandoctor's progress bar and the report they bury it. While
`capture_library_logs()` is active every `logging` record below ERROR from a logger outside nandoctor
is counted and its text kept (the last `keep` lines) instead of reaching any handler; errors still
pass, as they may explain a crash. The run puts them in `report.details["library_logs"]`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_KEEP = 200


@dataclass
class LibraryLogs:
    """What was held back: how many records, and the last `keep` of them as text."""

    keep: int = _KEEP
    count: int = 0
    lines: deque[str] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed log call in a library must not stop the run
            text = str(record.msg)
        line = f"{record.levelname} {record.name}: {text}"
        with self._lock:
            self.count += 1
            self.lines.append(line[:2000])
            while len(self.lines) > self.keep:
                self.lines.popleft()

    def as_details(self) -> dict[str, Any]:
        """`{"count": n, "lines": [...]}` for report.details["library_logs"]."""
        with self._lock:
            return {"count": self.count, "lines": list(self.lines)}


def _held_back(record: logging.LogRecord) -> bool:
    name = record.name or ""
    return record.levelno < logging.ERROR and name != "nandoctor" and not name.startswith("nandoctor.")


@contextlib.contextmanager
def capture_library_logs(keep: int = _KEEP) -> Iterator[LibraryLogs]:
    """Hold back non-nandoctor log records below ERROR for the duration; restores logging on exit.

    It replaces `Logger.callHandlers`, the one place every record goes through on its way to any
    handler (a library's own StreamHandler, the root's from basicConfig, or logging's last resort),
    so libraries that set `propagate = False` are covered too.
    """
    logs = LibraryLogs(keep=keep)
    original = logging.Logger.callHandlers

    def call_handlers(self: logging.Logger, record: logging.LogRecord) -> None:
        if _held_back(record):
            logs.add(record)
            return
        original(self, record)

    logging.Logger.callHandlers = call_handlers  # type: ignore[method-assign]
    try:
        yield logs
    finally:
        logging.Logger.callHandlers = original  # type: ignore[method-assign]
