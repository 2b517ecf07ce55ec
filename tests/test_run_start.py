"""`nandoctor run`'s parent process only supervises the script: what it imports is its fixed start, paid
whole by a short run (issue 36). Checked with Python's own import log of that process (`-X importtime`,
which the script's process does not inherit): a process, because its imports are what is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Imported by the watched script's process (Paddle itself imports numpy), never by the parent
NOT_IN_PARENT = ("numpy", "paddle", "yaml", "nandoctor.report.bundle", "nandoctor.spec", "nandoctor.inloop")


def _imported(stderr: str) -> set[str]:
    """The modules an `-X importtime` log names."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_the_parent_imports_neither_paddle_nor_numpy_nor_the_report_stack() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "nandoctor", "run", "--", sys.executable, "-c",
                           "pass"], capture_output=True, text=True, timeout=120, check=False)
    imported = _imported(done.stderr)
    assert "nandoctor.zero_change.runner" in imported, done.stderr[-2000:]  # the log is the parent's, and whole
    assert "nothing was watched" in done.stderr
    assert sorted(m for m in NOT_IN_PARENT if m in imported) == []


# Command lines of `nandoctor run`: entry.py reads the plain ones itself (no typer in the parent), leaves the others
RUN_LINES = [
    ["--", "python", "train.py", "--lr", "3e-4"],
    ["python", "train.py", "--", "--x"],
    ["--json", "r.json", "--markdown", "r.md", "-q", "--", "python", "t.py"],
    ["--json", "-", "--keep-going", "--force", "--bundle", "out", "python", "-c", "pass"],
    ["--quiet", "--", "--help"],
    ["-q", "-", "x"],
    ["--help"],
    ["--json"],
    ["--json", "--", "python"],
    ["--json=r.json", "--", "python"],
    ["-q", "-q", "--", "python"],
    ["-q", "--quiet", "--", "python"],
    ["--unknown", "--", "python"],
    ["-qx", "python"],
    ["--json", "", "--", "python"],
    ["--"],
    [],
]


def test_a_plain_run_command_line_is_read_as_typer_reads_it() -> None:
    """Ground truth: typer's own parse of `nandoctor run ARGS` (click's parser, the options of cli.py's
    `run`). Where entry.py reads a line itself, it gets the same options and command; it leaves to typer
    every line typer would answer otherwise (help, errors) or that it does not read."""
    import typer
    from typer.exceptions import TyperException

    from nandoctor.cli import app
    from nandoctor.entry import plain_run_args

    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    read_here = 0
    for args in RUN_LINES:
        mine = plain_run_args(list(args))
        try:
            ctx = run.make_context("run", list(args), resilient_parsing=False)
        except (typer.Exit, TyperException):  # (typer's own click: its Exit and UsageError)
            assert mine is None, args  # help or a usage error: typer's to print
            continue
        # (click's values: typer makes the paths Path and the command a list before calling `run`)
        params = {k: Path(v) if isinstance(v, str) else v for k, v in ctx.params.items() if v not in (None, False)}
        params["command"] = list(params["command"])
        if mine is not None:
            read_here += 1
            assert mine == params, args
    assert read_here == 6  # the first six lines: every option, `--` or not, `-` as a value and as the command
