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

from nandoctor.engine import interrupt
from nandoctor.errors import SpecError
from nandoctor.findings import SCHEMA, Report
from nandoctor.progress import ProgressFn, no_progress
from nandoctor.report.writer import check_not_an_input, check_writable_file, is_stdout, write_outputs, write_text
from nandoctor.spec import check_device, load_spec


def run_command(command: str, config: Path, console: Console, *, json_path: Path | None = None,
                markdown_path: Path | None = None, bundle: Path | None = None, force: bool = False,
                quiet: bool = False, **options: Any) -> int:
    """Run `scan` or `probe` on a spec and write every output asked for; returns the exit status
    (130/143 when Ctrl-C or SIGTERM stopped the run: the partial report is still written)."""
    with interrupt.handled():
        return _run_command(command, config, console, json_path=json_path, markdown_path=markdown_path,
                            bundle=bundle, force=force, quiet=quiet, **options)


def _run_command(command: str, config: Path, console: Console, *, json_path: Path | None,
                 markdown_path: Path | None, bundle: Path | None, force: bool, quiet: bool, **options: Any) -> int:
    spec = _load_run_spec(command, config, options)
    outputs = _checked_outputs(spec, options, json_path=json_path, markdown_path=markdown_path, bundle=bundle,
                               force=force)
    import paddle  # noqa: F401 - Paddle's import installs C++ signal handlers that dump a native stack

    interrupt.install()  # ... so Python's go back: SIGTERM ends the run with a partial report instead
    from nandoctor.engine.userlogs import capture_library_logs

    # The user's libraries log INFO/WARNING lines while their models build and train: kept off the
    # terminal and out of the report's text, counted in the report's details (and so in the bundle).
    with progress_bar(console, quiet) as on_progress, capture_library_logs() as library_logs:
        if command == "scan":
            report, flags = _scan(spec, options, on_progress)
        else:
            report, flags = _probe(spec, config, options, bundle, on_progress)
    if library_logs.count:
        report.details["library_logs"] = library_logs.as_details()
    report.run.setdefault("config", str(config))
    report.run["command_line"] = reproduce_command(command, config, flags)
    # The run imported the user's modules: none of them may be overwritten by a report either. Only a
    # `.py` output can be one, and walking sys.modules after a Paddle import costs 10-30 ms: only then.
    py_outputs = [p for p in outputs if p.suffix == ".py"]
    if py_outputs:
        check_not_an_input(py_outputs, imported_files(spec.base_dir))
    write_outputs(report, console, json_path=json_path, markdown_path=markdown_path, quiet=quiet)
    if bundle is not None:
        _write_bundle(report, spec, bundle, console, force=force, include_code=not options.get("no_code", False))
    if report.partial:
        return interrupt.exit_status()
    return report.exit_code


def _load_run_spec(command: str, config: Path, options: dict[str, Any]) -> Any:
    """The spec, with a Trainer checkpoint's resume in place of its own; refused at once when the run it asks
    for is not supported (before any import or model build)."""
    spec = load_spec(config)
    if options.get("resume") is not None:  # a Trainer's checkpoint-N folder, in place of a `resume` block
        from nandoctor.workload.resume import from_trainer_dir

        spec.resume = from_trainer_dir(Path(options["resume"]), spec)
    nproc_asked = int(options.get("nproc") or 1)
    if command == "probe" and nproc_asked > 1 and spec.resume is not None:
        raise SpecError(f"--nproc {nproc_asked} with a resume from a checkpoint ({spec.resume.source}) is not "
                        "supported yet: probe the resumed run in one process (leave --nproc out).")
    return spec


def _checked_outputs(spec: Any, options: dict[str, Any], *, json_path: Path | None, markdown_path: Path | None,
                     bundle: Path | None, force: bool) -> list[Path]:
    """The report files asked for, each checked writable and none of them one of the spec's inputs, and the
    bundle's target checked: a typo found before the run, not after a 200-step probe."""
    if options.get("device") is not None:  # a typo in --device should not wait for imports or a model build
        check_device(options["device"], "--device")
    outputs = [p for p in (json_path, markdown_path) if p is not None]
    for path in outputs:
        check_writable_file(path)
    check_not_an_input(outputs, spec_inputs(spec))
    if bundle is not None:
        from nandoctor.report.bundle import check_bundle_target

        check_bundle_target(bundle, force)
    return outputs


def _scan(spec: Any, options: dict[str, Any], on_progress: ProgressFn) -> tuple[Report, dict[str, Any]]:
    """`scan`: its report, and the flags that reproduce it."""
    from nandoctor.scan import ScanOptions, run_scan

    batches = options.get("batches")
    report = run_scan(spec, ScanOptions(batches=batches), on_progress)
    return report, {"--batches": batches}


def _probe(spec: Any, config: Path, options: dict[str, Any], bundle: Path | None,
           on_progress: ProgressFn) -> tuple[Report, dict[str, Any]]:
    """`probe`, in this process or in N through Paddle's launcher: its report, and the flags that reproduce it
    (the spec's defaults spelled out)."""
    from nandoctor.probe import ProbeOptions, run_probe

    opts = ProbeOptions(
        steps=options.get("steps") or spec.probe.steps,
        seed=options["seed"] if options.get("seed") is not None else spec.probe.seed,
        device=options.get("device") or spec.probe.device,
        try_fixes=options.get("try_fixes", True),
        fix_steps=options.get("fix_steps") or 20,
        bundle=bundle is not None,
    )
    nproc = int(options.get("nproc") or 1)
    if nproc > 1:  # N processes through Paddle's launcher, each training its share of the data
        check_nproc(nproc, opts.device)
        from nandoctor.probe.ranks import launch_probe

        report = launch_probe(Path(config).resolve(), opts.steps, opts.seed, nproc, opts.device)
    else:
        report = run_probe(spec, opts, on_progress)
    flags = {"--steps": opts.steps, "--seed": opts.seed, "--device": opts.device,
             "--nproc": nproc if nproc > 1 else None, "--resume": options.get("resume")}
    return report, flags


def _write_bundle(report: Report, spec: Any, bundle: Path, console: Console, *, force: bool,
                  include_code: bool) -> None:
    """The bundle for a bug ticket, and the line that says where it went."""
    from nandoctor.report.bundle import write_bundle

    written = write_bundle(report, spec, bundle, force=force, include_code=include_code)
    console.print(f"Bundle written to [bold]{written}[/] (attach it to the bug ticket).", soft_wrap=True)


def check_nproc(nproc: int, device: str) -> None:
    """Refuse more ranks than the machine has cores (CPU) or GPUs: they would start without a word and
    crawl, or hang waiting for one another at the first collective."""
    import os

    from nandoctor.tensors.device import resolve_device

    resolved = resolve_device(device)
    if resolved == "cpu":
        have, what = os.cpu_count() or 1, "CPU cores"
    else:
        import paddle

        have, what = paddle.device.cuda.device_count(), "GPUs"
    if nproc > have:
        raise SpecError(f"--nproc {nproc}: this machine has {have} {what}, and each rank is a process training on "
                        f"one ({resolved}). Use --nproc {have} or fewer (or leave --nproc out).")


def rerender(report_json: Path, console: Console, *, markdown_path: Path | None = None) -> int:
    """`nandoctor report`: read a saved JSON report and show it again (terminal or Markdown).

    The report may be anyone's: the renderers make its text inert and its images stay inside its folder;
    here a file nested too deeply to walk is refused (exit 2) rather than overflowing the stack.
    """
    from nandoctor.report.common import MAX_NESTING, inert, nesting_exceeds

    if report_json.is_dir() and (report_json / "report.json").is_file():
        report_json = report_json / "report.json"
    too_deep = SpecError(f"{report_json}: a malformed report: its lists and objects are nested more than "
                         f"{MAX_NESTING} levels deep (too deeply nested to be a nandoctor report). "
                         "Was it edited by hand or made by another tool? Re-create it with --json.")
    try:
        data = json.loads(report_json.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{report_json}: no such file. Pass a report.json written by --json or --bundle.") from None
    except RecursionError:  # the JSON parser's own stack, at about a thousand levels
        raise too_deep from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{report_json}: not a readable JSON report ({exc}).") from None
    if nesting_exceeds(data):
        raise too_deep
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = inert(f"schema {data.get('schema')!r}", 300) if isinstance(data, dict) else \
            f"a JSON {type(data).__name__}"
        raise SpecError(f"{report_json}: not a nandoctor report ({found}; expected \"schema\": \"{SCHEMA}\"). "
                        "Pass a report.json written by --json or --bundle.")
    check_report_keys(report_json, data)
    try:
        report = Report.from_dict(data)
    except (ValueError, KeyError, TypeError) as exc:
        problem = inert(f"the key {exc} is missing" if isinstance(exc, KeyError) else str(exc), 300)
        raise SpecError(f"{report_json}: not a complete nandoctor report ({problem}). Was it edited by hand or "
                        "cut short? Re-create it with --json.") from None
    if markdown_path is not None:
        check_writable_file(markdown_path)
        from nandoctor.report import markdown as markdown_report

        write_text(markdown_path, markdown_report.render(report, report_dir=report_json.parent,
                                                         markdown_dir=markdown_path.parent))
        if not is_stdout(markdown_path):
            console.print(f"Markdown written to {markdown_path}", markup=False, soft_wrap=True)  # a path unbroken
    else:
        from nandoctor.report import console as console_report

        console_report.render(report, console)
    return report.exit_code


def check_report_keys(path: Path, data: dict[str, Any]) -> None:
    """A report without its required keys is not 'healthy': it is not a report (exit 2)."""
    from nandoctor.findings import Verdict
    from nandoctor.report.common import inert

    missing = [k for k in REQUIRED_REPORT_KEYS if k not in data]
    problem = f"it has no {', '.join(repr(k) for k in missing)}" if missing else None
    if problem is None and not isinstance(data["findings"], list):
        problem = f"'findings' is a {type(data['findings']).__name__}, not a list"
    if problem is None and data["verdict"] not in [v.value for v in Verdict]:  # a list: a [] verdict is no TypeError
        problem = f"'verdict' is {data['verdict']!r}, not one of {', '.join(v.value for v in Verdict)}"
    if problem is None and data["command"] not in ("scan", "probe"):
        problem = f"'command' is {data['command']!r}, not 'scan' or 'probe'"
    if problem is not None:  # the values are quoted with repr (no raw control character), but may be long
        raise SpecError(f"{path}: not a complete nandoctor report ({inert(problem, 300)}). Was it edited by hand "
                        "or cut short? Re-create it with --json.")


REQUIRED_REPORT_KEYS = ("schema", "command", "verdict", "findings")


def spec_inputs(spec: Any) -> set[Path]:
    """The spec file and the files its entries name (file paths, or modules found under the spec folder)."""
    from nandoctor.workload.entrypoints import entry_files

    base = Path(spec.base_dir)
    resumed = {f.resolve() for f in spec.resume.files} if getattr(spec, "resume", None) is not None else set()
    return {Path(spec.path).resolve()} | resumed | {f.resolve() for e in spec.entries for f in entry_files(e, base)
                                                    if f.is_file()}


def imported_files(base_dir: Path) -> set[Path]:
    """The `.py` files under the spec's folder that the run imported (the user's modules and theirs)."""
    from nandoctor.workload.entrypoints import modules_imported_from

    return {p.resolve() for p in modules_imported_from(Path(base_dir))}


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
    # imported here: a run without a terminal (CI, a scheduler, a benchmark) never draws one (13 ms)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True)
    task = bar.add_task("starting", total=None)

    def update(done: int, total: int | None, description: str) -> None:
        bar.update(task, completed=done, total=total, description=description)

    with bar:
        yield update
