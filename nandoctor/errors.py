"""The exceptions nandoctor raises on purpose; the CLI catches `NandoctorError` once and exits with it.

Each class is one layer's base: a spec that cannot be loaded, a command line that makes no sense,
a place the report cannot be written. User code that raises mid-run is *not* an error of ours: it
becomes a `user_code.error` finding in a report that is still written.
"""

from __future__ import annotations


class NandoctorError(Exception):
    """Something the user can fix; `str(err)` is a one-paragraph message that says what and where."""

    exit_code = 2


class SpecError(NandoctorError):
    """The YAML spec is missing, malformed, names a bad key or an entry point that cannot be loaded."""


class UsageError(NandoctorError):
    """A command-line value that cannot work (a device that is not there, a negative step count)."""


class OutputError(NandoctorError):
    """A report or bundle cannot be written where the user asked."""


class UserCodeError(Exception):
    """The user's model, data, loss or step code raised; carries where, so it can become a finding.

    `origin` is "file.py:LINE in function" from the innermost traceback frame inside the user's own
    files (not Paddle's, not ours), so the message points at code the user can open.
    """

    def __init__(self, what: str, exc: BaseException, origin: str | None = None) -> None:
        self.what = what
        self.exc = exc
        self.origin = origin
        where = f" at {origin}" if origin else ""
        super().__init__(f"{what} raised {type(exc).__name__}{where}: {exc}")
