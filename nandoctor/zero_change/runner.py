"""The parent side of `nandoctor run`: run COMMAND with the watcher preloaded, then report.

The command runs as a child with its own stdin/stdout/stderr, so its output passes through untouched;
with nothing found its exit status is ours. After a fault the child writes the report (JSON) to a file
in a private temporary folder and stops with status 1 (unless --keep-going); the parent renders it,
writes --json / --markdown, and exits 1. Under `python -m paddle.distributed.launch` every rank is
watched (the variable and PYTHONPATH are inherited) and rank 0's merged report is the one shown.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from rich.console import Console

from nandoctor.errors import OutputError, SpecError
from nandoctor.findings import Report, Verdict

SITE = Path(__file__).resolve().parent / "site"


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def run_script(command: list[str], console: Console, *, json_path: Path | None = None,
               markdown_path: Path | None = None, bundle: Path | None = None, keep_going: bool = False,
               quiet: bool = False) -> int:
    """Run `command` watched; the exit status `nandoctor run` returns."""
    from nandoctor.run import check_writable_file, write_outputs

    if not command:
        raise SpecError("nothing to run: give the command after --, e.g. `nandoctor run -- python train.py`.")
    for path in (json_path, markdown_path):
        if path is not None:
            check_writable_file(path)
    with tempfile.TemporaryDirectory(prefix="nandoctor-run-") as tmp:
        result = Path(tmp) / "report.json"
        config = {"result": str(result), "report_dir": str(bundle.resolve()) if bundle is not None else None,
                  "keep_going": keep_going}
        env = dict(os.environ)
        env["NANDOCTOR_RUN"] = json.dumps(config)
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
        try:
            proc = subprocess.run(command, env=env)
        except FileNotFoundError:
            raise SpecError(f"cannot run {command[0]!r}: no such program. Give the full command after --, e.g. "
                            "`nandoctor run -- python train.py`.") from None
        except PermissionError:
            raise SpecError(f"cannot run {command[0]!r}: it is not executable.") from None
        except KeyboardInterrupt:
            return 130
        if not result.is_file():
            if not (Path(tmp) / "watched").exists():
                _stderr().print(f"nandoctor run: nothing was watched: {' '.join(command[:3])} never stepped a "
                                "Paddle optimizer on a model in training mode (or its Python cannot import "
                                "nandoctor). The command's own exit status follows.", markup=False)
            return proc.returncode  # nothing found: the script's own status
        try:
            report = Report.from_dict(json.loads(result.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OutputError(f"the watched run's report could not be read ({exc}).") from None
    report.run["command_line"] = shlex.join(command)
    # A clean run's output stays the script's own: one line on stderr; the files are written all the same
    write_outputs(report, _stderr() if report.verdict == Verdict.HEALTHY else console, json_path=json_path,
                  markdown_path=markdown_path, quiet=quiet or report.verdict == Verdict.HEALTHY)
    if bundle is not None and (bundle / "report.json").is_file():
        console.print(f"Report folder written to [bold]{bundle}[/].")
    return 1 if report.exit_code else (proc.returncode or 0)
