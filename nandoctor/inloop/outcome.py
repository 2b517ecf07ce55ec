"""What an in-loop watch found -> the probe's Report, and that report written to `report_dir`.

The findings come from the probe's own diagnosis (`nandoctor.probe.diagnose`: the replay, the sample
bisection, the wording), so a fault caught in a user's loop reads exactly as `nandoctor probe` would put
it. The folder
holds report.json, report.md, plots/, batch.npz, state.npz, rng_state.json, environment.json and a
README: the bundle's inert files (there is no spec, so no spec.yaml, code/ or reproduce.py).
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

from nandoctor import env
from nandoctor.findings import Mode, Report
from nandoctor.probe.diagnose import StepTarget, diagnose, record_run
from nandoctor.probe.watcher import Fault

log = logging.getLogger("nandoctor")


def new_report(device: str, mode: Mode) -> Report:
    """An in-loop report; `run.mode` names the way in (its title: `Mode.title`)."""
    report = Report(command="probe", run={"mode": mode.value, "device": device})
    report.environment = env.collect()
    report.environment["device"] = device
    return report


def fill_report(report: Report, watcher: Any, fault: Fault | None, steps_run: int, *, target: StepTarget,
                optimizer: Any, start_bad: list[Any] | None = None) -> None:
    """Timeline, per-layer details, the fault's findings (diagnose.py, as the probe's) and warnings;
    `start_bad`: parameters NaN/Inf when the watch began (nan_params.BadParam), named as the fault's cause."""
    from nandoctor.probe import nan_params

    records = list(watcher.records)
    record_run(report, records, watcher.monitor, steps_run=steps_run, stats_every=list(watcher.stats_every))
    if start_bad:
        nan_params.before_training(report, start_bad, can_stop=False)
    diagnose(report, fault, target, optimizer)
    if start_bad:
        nan_params.after_run(report, start_bad, fault, target, steps_run, records)
    report.findings += watcher.warnings(fault)
    from nandoctor.probe import causes
    from nandoctor.probe.watcher import current_lr

    # the probe's own causes and advice (the growth before the fault, the data's scale), in the user's mode
    label = target.label_name(fault.fields) if fault is not None and fault.fields else None
    causes.explain(report, fault, records, current_lr(optimizer), label=label)


def render_text(report: Report) -> str:
    """The console report as plain text, for `logging`."""
    from rich.console import Console

    from nandoctor.report import console as console_report

    buf = io.StringIO()
    console_report.render(report, Console(file=buf, width=110, force_terminal=False, color_system=None))
    return buf.getvalue()


def write_report(report: Report, folder: Path) -> Path:
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
