"""The application layer between the CLI and the core: load the spec, run scan or probe, render, write.

Kept out of `cli.py` so the CLI holds only options; kept out of the core so scan and probe never know
about terminals or files. Output paths are checked *before* a run, so a typo in `--json` does not cost
a 200-step probe.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from nandoctor.errors import OutputError, SpecError
from nandoctor.findings import SCHEMA, Report
from nandoctor.progress import ProgressFn, no_progress
from nandoctor.spec import check_device, load_spec


def run_command(command: str, config: Path, console: Console, *, json_path: Path | None = None,
                markdown_path: Path | None = None, bundle: Path | None = None, force: bool = False,
                quiet: bool = False, **options: Any) -> int:
    """Run `scan` or `probe` on a spec and write every output asked for; returns the exit status."""
    spec = load_spec(config)
    if options.get("device") is not None:  # a typo in --device should not wait for imports or a model build
        check_device(options["device"], "--device")
    for path in (json_path, markdown_path):
        if path is not None:
            check_writable_file(path)
    if bundle is not None:
        from nandoctor.report.bundle import check_bundle_target

        check_bundle_target(bundle, force)
    with progress_bar(console, quiet) as on_progress:
        if command == "scan":
            from nandoctor.scan import ScanOptions, run_scan

            batches = options.get("batches")
            report = run_scan(spec, ScanOptions(batches=batches), on_progress)
            flags = {"--batches": batches}
        else:
            from nandoctor.probe import ProbeOptions, run_probe

            opts = ProbeOptions(
                steps=options.get("steps") or spec.probe.steps,
                seed=options["seed"] if options.get("seed") is not None else spec.probe.seed,
                device=options.get("device") or spec.probe.device,
            )
            report = run_probe(spec, opts, on_progress)
            flags = {"--steps": opts.steps, "--seed": opts.seed, "--device": opts.device}
    report.run.setdefault("config", str(config))
    report.run["command_line"] = reproduce_command(command, config, flags)
    write_outputs(report, console, json_path=json_path, markdown_path=markdown_path, quiet=quiet)
    if bundle is not None:
        from nandoctor.report.bundle import write_bundle

        written = write_bundle(report, spec, bundle, force=force)
        console.print(f"Bundle written to [bold]{written}[/] (attach it to the bug ticket).")
    return report.exit_code


def write_outputs(report: Report, console: Console, *, json_path: Path | None, markdown_path: Path | None,
                  quiet: bool = False) -> None:
    from nandoctor.report import console as console_report
    from nandoctor.report import json as json_report
    from nandoctor.report import markdown as markdown_report

    if quiet:
        console_report.render_verdict_line(report, console)
    else:
        console_report.render(report, console)
    if json_path is not None:
        write_text(json_path, json_report.render(report))
    if markdown_path is not None:
        write_text(markdown_path, markdown_report.render(report))


def rerender(report_json: Path, console: Console, *, markdown_path: Path | None = None) -> int:
    """`nandoctor report`: read a saved JSON report and show it again (terminal or Markdown)."""
    if report_json.is_dir() and (report_json / "report.json").is_file():
        report_json = report_json / "report.json"
    try:
        data = json.loads(report_json.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{report_json}: no such file. Pass a report.json written by --json or --bundle.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{report_json}: not a readable JSON report ({exc}).") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = f"schema {data.get('schema')!r}" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise SpecError(f"{report_json}: not a nandoctor report ({found}; expected \"schema\": \"{SCHEMA}\"). "
                        "Pass a report.json written by --json or --bundle.")
    try:
        report = Report.from_dict(data)
    except (ValueError, KeyError, TypeError) as exc:
        problem = f"the key {exc} is missing" if isinstance(exc, KeyError) else str(exc)
        raise SpecError(f"{report_json}: not a complete nandoctor report ({problem}). Was it edited by hand or "
                        "cut short? Re-create it with --json.") from None
    if markdown_path is not None:
        check_writable_file(markdown_path)
        from nandoctor.report import markdown as markdown_report

        write_text(markdown_path, markdown_report.render(report))
        console.print(f"Markdown written to {markdown_path}")
    else:
        from nandoctor.report import console as console_report

        console_report.render(report, console)
    return report.exit_code


def check_writable_file(path: Path) -> None:
    """Fail before the run, with exit 2, if `path` cannot be written."""
    if path.is_dir():
        raise OutputError(f"{path} is a folder; give a file name such as {path / 'report.json'}.")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise OutputError(f"cannot write {path}: the folder {parent} does not exist. Create it or pick another path.")
    import os

    if not os.access(parent, os.W_OK):
        raise OutputError(f"cannot write {path}: the folder {parent} is not writable.")


def write_text(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}.") from None


def reproduce_command(command: str, config: Path, flags: dict[str, Any]) -> str:
    """The command that reproduces this report, with every value that shaped the run spelled out.

    Built from the resolved options rather than sys.argv, so defaults taken from the spec (steps, seed,
    device) are pinned and output flags (--json, --bundle) are left out.
    """
    parts = ["nandoctor", command, shlex.quote(str(config))]
    for flag, value in flags.items():
        if value is not None:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


@contextlib.contextmanager
def progress_bar(console: Console, quiet: bool) -> Iterator[ProgressFn]:
    """A rich progress bar fed by the core's progress callback; nothing at all when quiet or not a terminal."""
    if quiet or not console.is_terminal:
        yield no_progress
        return
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True)
    task = bar.add_task("starting", total=None)

    def update(done: int, total: int | None, description: str) -> None:
        bar.update(task, completed=done, total=total, description=description)

    with bar:
        yield update
