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



# Loaded in the script's process only once it imports Paddle (which brings numpy itself)
NOT_BEFORE_PADDLE = ("numpy", "nandoctor.zero_change.model_watch", "nandoctor.zero_change.capture", "nandoctor.inloop")


def test_a_watched_process_that_never_imports_paddle_loads_neither_numpy_nor_the_watch() -> None:
    """The launcher's helpers, pip, a tool the script starts: the watch waits for Paddle's import. Its models'
    seams and numpy (~60 ms of a short process) came with the sitecustomize before."""
    probe = f"import sys; print(sorted(m for m in {NOT_BEFORE_PADDLE!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-m", "nandoctor", "run", "--", sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=120, check=False)
    assert "nothing was watched" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"

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


# A script that trains and never imports PyYAML itself; after its run it prints the modules it ended with
_NO_YAML_SCRIPT = """
import sys
import paddle
model = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 2))
opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
for _ in range(8):
    loss = paddle.nn.functional.cross_entropy(model(paddle.randn([8, 4])), paddle.randint(0, 2, [8, 1]))
    loss.backward()
    opt.step()
    opt.clear_grad()
print("watched:", "nandoctor.inloop.doctor" in sys.modules, "yaml:", "yaml" in sys.modules)
"""


def test_a_watched_script_does_not_load_pyyaml(tmp_path: Path) -> None:
    """The watch reads no spec: PyYAML (~13 ms to import) stays out of a script that does not import it. It
    came in through the advice's YAML formatting and the spec package's file reader."""
    script = tmp_path / "train.py"
    script.write_text(_NO_YAML_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "nandoctor", "run", "--json", str(tmp_path / "r.json"), "--",
                           sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False,
                          cwd=tmp_path)
    assert "watched: True yaml: False" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
