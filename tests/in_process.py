"""Run a test script as `python SCRIPT ARGS` would, or `nandoctor ARGS`, in this process: no new interpreter,
no Paddle start-up.

A subprocess pays 3-4 s of Python and Paddle start-up before the first line of the script; the parity suite
ran ~100 of them for scripts whose process is not what it checks (their losses and their report are). This
runs the script as `__main__` instead (runpy), with what a fresh process would give it and what it would
take away:

- its folder first on sys.path, argv, its own working folder; stdout and stderr captured; the exit status
  `sys.exit` gives, and 1 with the traceback on stderr for an uncaught exception, as the interpreter does;
- the modules of its own folder and of `user_dirs` imported afresh, and forgotten afterwards;
- afterwards, the rest of the process state a script (or the user code it imports) changes is put back:
  sys.path, argv, the device, the default dtype, grad mode, the Paddle flags of the tensor checker, the
  RNGs, the signal and exception hooks, the warning filters, so that no test after it sees a trace of it.

`run_cli` is typer's CliRunner from a given folder, the spec's modules imported afresh as above; the CLI
itself puts back what else it changes (signal handlers, the tensor checker, the user's import path), which
the in-process CLI tests rely on already.

Kept for a real process: anything whose process is the point (signals, a real exit status, stdout/stderr
separation, `nandoctor run`'s child, ranks, reproduce.py), and DataLoader worker processes (forked from
pytest, a worker left waiting by a crash is joined by a later garbage collection, for ever).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import runpy
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_FLAGS = ("FLAGS_check_nan_inf", "FLAGS_check_nan_inf_level", "FLAGS_call_stack_level")


@dataclass
class Ran:
    """What `subprocess.run(..., capture_output=True, text=True)` returns, for the fields the tests read."""

    returncode: int
    stdout: str
    stderr: str


def _status(code: object, err: io.StringIO) -> int:
    """sys.exit(code)'s exit status: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=err)
    return 1


def _in(dirs: tuple[str, ...]) -> list[str]:
    """The names of the modules imported from a file under one of `dirs` (resolved, ending in a separator)."""
    return [name for name, module in list(sys.modules.items())
            if str(getattr(module, "__file__", None) or "").startswith(dirs)]


@contextlib.contextmanager
def _own_modules(dirs: tuple[Path, ...]) -> Iterator[None]:
    """The modules of the files under `dirs` as a new process has them: none imported before, all forgotten
    after (the ones this process had are put back). A sample's module holds state (a stream's read position)
    that a second run in the same process would otherwise start from."""
    prefixes = tuple(str(d.resolve()) + os.sep for d in dirs)
    before = {name: sys.modules.pop(name) for name in _in(prefixes)}
    try:
        yield
    finally:
        for name in _in(prefixes):
            del sys.modules[name]
        sys.modules.update(before)


def run_in_process(script: Path, args: list[str], cwd: Path, user_dirs: tuple[Path, ...] = ()) -> Ran:
    """`python SCRIPT ARGS` in `cwd`, run here -> Ran(exit status, stdout, stderr). The modules of the
    script's folder and of `user_dirs` (the samples' own code) are imported afresh and forgotten after, as
    with a process."""
    import numpy as np
    import paddle

    saved_path, saved_argv = list(sys.path), list(sys.argv)
    saved_device, saved_dtype, saved_grad = paddle.get_device(), paddle.get_default_dtype(), paddle.is_grad_enabled()
    saved_flags = paddle.get_flags(list(_FLAGS))
    saved_rng = (random.getstate(), np.random.get_state(), paddle.get_rng_state())
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_hooks = (sys.excepthook, threading.excepthook)
    saved_cwd = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        os.chdir(cwd)
        sys.argv = [str(script), *args]
        sys.path.insert(0, str(script.parent))  # as `python SCRIPT` does
        with _own_modules((script.parent, *user_dirs)), warnings.catch_warnings(), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
                status = 0
            except SystemExit as exc:
                status = _status(exc.code, err)
            except Exception:  # noqa: BLE001 - an uncaught exception: the interpreter prints it, exit 1
                traceback.print_exc(file=err)
                status = 1
    finally:
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        sys.path[:] = saved_path
        paddle.set_device(saved_device)
        paddle.set_default_dtype(saved_dtype)
        paddle.set_grad_enabled(saved_grad)
        paddle.set_flags(saved_flags)
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])
        paddle.set_rng_state(saved_rng[2])
        for signum, handler in saved_signals.items():
            signal.signal(signum, handler)
        sys.excepthook, threading.excepthook = saved_hooks
    return Ran(status, out.getvalue(), err.getvalue())


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None, user_dirs: tuple[Path, ...] = ()) -> Ran:
    """`nandoctor ARGS` from `cwd`, through typer's CliRunner -> Ran(exit status, stdout, stderr), with the
    traceback of an exception of nandoctor's on stderr, as the interpreter would print it. The modules of
    files under `user_dirs` (the spec's code) are imported afresh and forgotten after, as with a process."""
    from typer.testing import CliRunner

    from nandoctor.cli import app

    here = os.getcwd()
    os.chdir(cwd)
    try:
        with _own_modules(user_dirs):
            result = CliRunner(env=env).invoke(app, args)
    finally:
        os.chdir(here)
    crash = "" if result.exc_info is None or isinstance(result.exception, SystemExit) else "".join(
        traceback.format_exception(*result.exc_info))
    return Ran(result.exit_code, result.stdout, result.stderr + crash)
