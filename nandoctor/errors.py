"""The exceptions nandoctor raises on purpose; the CLI catches `NandoctorError` once and exits with it.

Each class is one layer's base: a spec that cannot be loaded, a command line that makes no sense,
a place the report cannot be written. User code that raises mid-run is *not* an error of ours: it
becomes a `user_code.error` finding in a report that is still written.
"""

from __future__ import annotations

from pathlib import Path


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


INTERNAL_EXIT = 3


def save_internal_error(exc: BaseException, folder: Path, argv: list[str]) -> Path | None:
    """Write the traceback of nandoctor's own failure to `nandoctor-internal-error-<time>.txt` in `folder`
    (the --json folder or the current one, never $TMPDIR: the user must be able to find and attach it).
    Returns the file, or None when it cannot be written."""
    import platform
    import sys
    import time
    import traceback

    from nandoctor import __version__

    stamp = time.strftime("%Y%m%d-%H%M%S")
    text = (f"nandoctor {__version__}, Python {sys.version.split()[0]}, {platform.platform()}\n"
            f"command: {' '.join(argv)}\n\n"
            + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    for n in range(10):  # two failures in one second: a second file, never an overwrite
        path = folder / f"nandoctor-internal-error-{stamp}{f'-{n}' if n else ''}.txt"
        try:
            with open(path, "x", encoding="utf-8") as fh:
                fh.write(text)
            return path
        except FileExistsError:
            continue
        except OSError:
            return None
    return None
