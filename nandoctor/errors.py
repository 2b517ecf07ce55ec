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


# The command that installs Paddle with nandoctor (the `cpu` extra), and the wheel for a GPU: Paddle 3's are
# on PaddlePaddle's own package index only (a bare `pip install paddlepaddle-gpu` gets 2.6 from PyPI).
INSTALL_PADDLE = ('pip install "nandoctor[cpu]" (or, for an NVIDIA GPU, the paddlepaddle-gpu 3.x wheel for your CUDA '
                  "version, with the pip command of PaddlePaddle's install page: PyPI's stops at 2.6)")


class PaddleMissing(NandoctorError):
    """Paddle is not installed where nandoctor runs: the user's set-up, not a bug of ours (exit 2)."""

    def __init__(self, detail: str = "") -> None:
        import sys

        why = f" ({detail})" if detail else ""
        super().__init__(f"PaddlePaddle is not installed in this Python ({sys.executable}){why}. nandoctor runs "
                         f"your training with it: install it with {INSTALL_PADDLE}, then run the command again.")


def paddle_installed() -> bool:
    """Whether `import paddle` can find Paddle, without importing it (a second of start-up)."""
    import importlib.util

    try:
        return importlib.util.find_spec("paddle") is not None
    except (ImportError, ValueError):  # a broken or hidden installation says the same as a missing one
        return False


def paddle_missing(exc: BaseException) -> PaddleMissing | None:
    """The message for an ImportError that means "Paddle is not installed"; None for any other (a missing
    Paddle submodule or a broken install is not fixed by installing it, so it stays what it is)."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None or exc.name.split(".")[0] != "paddle":
        return None
    return None if paddle_installed() else PaddleMissing()


def path_error(exc: OSError, paths: dict[str, Path | None]) -> NandoctorError | None:
    """An OSError on a path the user gave (`--json`, `--markdown`, `--bundle`, the spec or report), or on a file
    inside it (a bundle's files), as a message naming that path (exit 2): a name too long for the file
    system, a read-only disk, a full one are the user's to change. None when the error is on a path of
    ours: that one is a bug."""
    import os

    failed = [os.path.abspath(os.fsdecode(f)) for f in (exc.filename, exc.filename2) if f is not None]
    for what, path in paths.items():
        if path is None:
            continue
        mine = os.path.abspath(os.fspath(path))
        if any(f == mine or f.startswith(mine.rstrip(os.sep) + os.sep) for f in failed):
            reason = exc.strerror or str(exc)
            if what == "spec":
                return SpecError(f"cannot read the spec {path}: {reason}. Pass the path of your nandoctor YAML "
                                 "spec.")
            if what == "report":
                return SpecError(f"cannot read the report {path}: {reason}. Pass a report.json written by --json "
                                 "or --bundle.")
            return OutputError(f"cannot write {what} {path}: {reason}. Pick another path.")
    return None


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
# Project-URL labels that name where bugs are reported, lower-cased; a Homepage or Documentation is not one.
_TRACKER_LABELS = ("issues", "bug tracker", "tracker", "bugs")


def issue_tracker() -> str | None:
    """Where nandoctor's bugs are reported: the `Issues` (else `Bug Tracker`, ...) project URL of the
    installed package's metadata, so the message follows pyproject.toml's [project.urls]. None while that
    names no tracker (nandoctor has no public home yet) or nandoctor is not installed."""
    from importlib import metadata

    try:
        urls = metadata.metadata("nandoctor").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    named = dict(u.split(",", 1) for u in urls if "," in u)
    named = {k.strip().lower(): v.strip() for k, v in named.items()}
    return next((named[k] for k in _TRACKER_LABELS if named.get(k)), None)


def internal_error_message(exc: BaseException, saved: Path | None) -> str:
    """The one paragraph for nandoctor's own failure: what, where the traceback is, and the report to make
    with it: at the issue tracker the package metadata names, else to nandoctor's maintainers."""
    tracker = issue_tracker()
    to = f"at {tracker}" if tracker else "to nandoctor's maintainers"
    if saved is not None:
        where, attach = f"The traceback is saved in {saved.resolve()}.", "attach that file"
    else:
        where = "The traceback could not be saved to a file, so it follows."
        attach = "copy the traceback below into the report"
    return (f"nandoctor: internal error, a bug in nandoctor (not in your code or spec): {type(exc).__name__}: "
            f"{str(exc)[:300]}. {where} Please report this bug {to} with the title \"nandoctor bug: "
            f"{type(exc).__name__}\" and {attach}.")


def save_internal_error(exc: BaseException, folder: Path, argv: list[str]) -> Path | None:
    """Write the traceback of nandoctor's own failure to `nandoctor-internal-error-<time>.txt` in `folder`
    (the --json folder or the current one, never $TMPDIR: the user must be able to find and attach it).
    Returns the file, or None when it cannot be written."""
    import platform
    import sys
    import time
    import traceback

    from nandoctor.version import __version__

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
