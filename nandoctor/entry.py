"""The command line's half without typer or rich: the one error funnel, and `nandoctor run` on a plain
command line, read before typer is imported.

`nandoctor run`'s parent only supervises the script: on a 60-step run of a 500-layer MLP its whole cost is
a few percent, and importing typer and building its commands was ~45 ms of CPU of it (issue 36). A `run`
command line this module reads exactly as typer would (`plain_run_args`) is run from here; any other (its
--help, an option it does not know, `--json=PATH`, a missing value) goes to typer (`cli.py`), which owns
the options, the help and the errors. rich is imported only when something is printed with it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nandoctor.errors import (
    INTERNAL_EXIT,
    NandoctorError,
    PaddleMissing,
    internal_error_message,
    paddle_installed,
    paddle_missing,
    path_error,
    save_internal_error,
)

if TYPE_CHECKING:
    from rich.console import Console

# Paddle's import warns about a missing ccache (a build tool for C++ extensions) on every machine without
# one: noise under a diagnosis, and nothing the user needs to act on.
warnings.filterwarnings("ignore", message=".*ccache.*")

# `nandoctor run`'s options (cli.py's `run`): those taking a value, and the flags
RUN_VALUES = {"--json": "json_path", "--markdown": "markdown_path", "--bundle": "bundle"}
RUN_FLAGS = {"--keep-going": "keep_going", "--force": "force", "--quiet": "quiet", "-q": "quiet"}


def plain_run_args(args: list[str]) -> dict[str, Any] | None:
    """The options and COMMAND of `run ARGS` when typer would read them the same way: each option of
    `nandoctor run` at most once, a value of its own after each that takes one (`-` or not an option),
    then `--` or the command's first word, and a command. None for anything else, which typer reads."""
    options: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break  # the command's first word (typer stops reading options there)
        name = RUN_VALUES.get(arg) or RUN_FLAGS.get(arg)
        if name is None or name in options:
            return None  # --help, an option typer knows under another spelling, or an unknown one
        if arg in RUN_FLAGS:
            options[name] = True
            i += 1
            continue
        value = args[i + 1] if i + 1 < len(args) else ""
        if not value or value.startswith("-") and value != "-":
            return None  # a missing value: typer's error
        options[name] = Path(value)
        i += 2
    command = args[i:]
    return {"command": command, **options} if command else None


def run_status(command: list[str], *, json_path: Path | None = None, markdown_path: Path | None = None,
               bundle: Path | None = None, keep_going: bool = False, force: bool = False, quiet: bool = False
               ) -> int:
    """`nandoctor run`: the command watched, through the error funnel; its exit status."""
    from nandoctor.zero_change.runner import run_script

    def call() -> int:
        if not paddle_installed():  # the script would fail at its `import paddle`, or train unwatched
            raise PaddleMissing()
        return run_script(list(command), lambda: console_for(json_path, markdown_path), json_path=json_path,
                          markdown_path=markdown_path, bundle=bundle, keep_going=keep_going, quiet=quiet, force=force)

    return exit_status(call, {"--json": json_path, "--markdown": markdown_path, "--bundle": bundle},
                       json_path or markdown_path)


def console_for(*outputs: Path | None) -> Console:
    """Where the report for people goes: standard output, unless `--json -` (or `--markdown -`) took it."""
    from rich.console import Console

    from nandoctor.report.writer import is_stdout

    return Console(stderr=any(is_stdout(p) for p in outputs), highlight=False)


def _stderr() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def fail(err: NandoctorError) -> int:
    """Our error's one message on standard error; its exit status."""
    from rich.markup import escape

    # The message quotes the user's text and YAML (`such as [x, y]`): escaped, or rich would eat the brackets.
    _stderr().print(f"[bold red]nandoctor:[/] {escape(str(err))}", markup=True)
    return err.exit_code


def _interrupted(exc: BaseException) -> int:
    """A signal before a report existed (spec loading, imports) or while it was written."""
    from rich.console import Console

    from nandoctor.engine import interrupt

    Console(stderr=True, highlight=False).print(f"nandoctor: stopped by {interrupt.name(exc)}; no report was written.")
    return interrupt.exit_status(exc)


def internal(exc: BaseException, near: Path | None) -> int:
    """nandoctor's own bug: one message asking to report it, the traceback in a file, exit 3."""
    folder = near.parent if near is not None and str(near.parent) and str(near) != "-" else Path(".")
    try:
        folder = folder if folder.is_dir() else Path(".")
    except OSError:  # a --json folder name too long to look at
        folder = Path(".")
    saved = save_internal_error(exc, folder, sys.argv)
    err = _stderr()
    err.print(internal_error_message(exc, saved), markup=False)
    if saved is None:
        import traceback

        err.print("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), markup=False)
    return INTERNAL_EXIT


def _user_error(exc: Exception, paths: dict[str, Path | None]) -> NandoctorError | None:
    """An exception that is the user's set-up after all: Paddle not installed, or a path they gave that the
    file system refuses (too long, read-only, full). Anything else that reaches the CLI is ours."""
    if isinstance(exc, ImportError):
        return paddle_missing(exc)
    if isinstance(exc, OSError):
        return path_error(exc, paths)
    return None


def exit_status(call: Callable[[], int], paths: dict[str, Path | None], near: Path | None) -> int:
    """The one error funnel of every command: `call()`'s exit status; our own errors (NandoctorError) as one
    message and their status; a signal as its status; a path or a missing Paddle as the user's set-up
    (exit 2); anything else as nandoctor's bug (exit 3, the traceback saved near `near`). The user's own
    errors never get here: they became findings, or the script's exit status."""
    try:
        return call()
    except NandoctorError as err:
        return fail(err)
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except Exception as exc:  # noqa: BLE001 - what reaches the CLI and is not the user's set-up is ours
        mistake = _user_error(exc, paths)
        if mistake is not None:
            return fail(mistake)
        return internal(exc, near)
