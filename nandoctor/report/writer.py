"""Writing a report: the JSON and Markdown files of `--json`/`--markdown`, and an in-loop report's folder.

One writer for every way in (the CLI's commands, `nandoctor run`, `nandoctor.watch`, the callbacks and the
ranks), so a path is checked, `-` means standard output, and a folder holds the same files whoever wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from nandoctor.errors import OutputError
from nandoctor.findings import Report

if TYPE_CHECKING:
    from rich.console import Console


def write_outputs(report: Report, console: Console | None, *, json_path: Path | None, markdown_path: Path | None,
                  quiet: bool = False) -> None:
    """The report shown on `console` (its verdict line alone when `quiet`; `console` None: that line as plain
    text on standard error, see common.plain_text_stream), then --json and --markdown written."""
    from nandoctor.report import json as json_report

    if markdown_path is not None:
        report.run["markdown_written"] = str(markdown_path)  # the footer then does not ask for --markdown
    if console is None:
        import sys

        from nandoctor.report.common import verdict_line

        verdict, rest = verdict_line(report)
        sys.stderr.write(f"{verdict.value}{rest}\n")
        sys.stderr.flush()
    else:
        from nandoctor.report import console as console_report

        if quiet:
            console_report.render_verdict_line(report, console)
        else:
            console_report.render(report, console)
    if json_path is not None:
        write_text(json_path, json_report.render(report))  # `--json -`: standard output
    if markdown_path is not None:
        from nandoctor.report import markdown as markdown_report

        write_text(markdown_path, markdown_report.render(report))


def is_stdout(path: Path | None) -> bool:
    """`--json -`: the JSON goes to standard output (and the report for people to standard error)."""
    return path is not None and str(path) == "-"


def check_writable_file(path: Path) -> None:
    """Fail before the run, with exit 2, if `path` cannot be written: by creating it (and removing it
    again), since `os.access` misses names too long for the filesystem and read-only mounts."""
    if is_stdout(path):
        return
    try:
        if path.is_dir():
            raise OutputError(f"{path} is a folder; give a file name such as {path / 'report.json'}.")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.exists():
            raise OutputError(f"cannot write {path}: the folder {parent} does not exist. Create it or pick another "
                              "path.")
        existed = path.exists()
        with open(path, "a" if existed else "x", encoding="utf-8"):
            pass  # "a" leaves an existing file's content as it is; it is replaced only after the run
        if not existed:
            path.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}. Pick another path.") from None


def check_not_an_input(outputs: list[Path], inputs: set[Path]) -> None:
    """A report must never overwrite the spec or the code the run imports (exit 2)."""
    for out in outputs:
        if is_stdout(out):
            continue
        target = out.resolve()
        if target in inputs:
            what = "the spec" if target.suffix in (".yaml", ".yml") else "a file the run imports"
            raise OutputError(f"refusing to write the report to {out}: it is {what} ({target}), which it would "
                              "overwrite. Pick another path, e.g. report.json.")


def write_text(path: Path, text: str) -> None:
    if is_stdout(path):
        import sys

        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}.") from None


def write_folder(report: Report, folder: Path) -> Path:
    """report.json, report.md and the inert bundle files into `folder` (created; files replaced)."""
    from nandoctor.report import json as json_report
    from nandoctor.report import markdown as markdown_report
    from nandoctor.report.bundle_files import save_artifacts
    from nandoctor.report.plots import make_plots

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        plots = make_plots(report, folder / "plots")
    except Exception:  # noqa: BLE001 - plots are a nicety (matplotlib missing, a headless quirk)
        plots = {}
    if plots:
        report.details["plots"] = {title: f"plots/{name}" for title, name in plots.items()}
    notes = save_artifacts(report, folder)
    (folder / "report.json").write_text(json_report.render(report), encoding="utf-8")
    (folder / "report.md").write_text(markdown_report.render(report), encoding="utf-8")
    (folder / "environment.json").write_text(json.dumps(report.to_dict()["environment"], indent=2, sort_keys=True)
                                             + "\n", encoding="utf-8")
    ff = report.first_fault
    lines = [f"nandoctor in-loop report: verdict {report.verdict.value}", ""]
    if ff is not None:
        lines += ["First fault: " + ff.as_location().describe(), ""]
    lines += ["report.md / report.json: the report; batch.npz: the offending batch; state.npz: the model's "
              "parameters before the failing step; rng_state.json: the RNG state before it (all load without "
              "pickle)."]
    if notes:
        lines += ["", "Not included:"] + [f"- {n}" for n in notes]
    (folder / "README.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder
