"""What an in-loop watch found -> the probe's Report, and that report written to `report_dir`.

The findings come from the probe's own code (`nandoctor.probe._handle_fault`: the replay, the sample
bisection, the wording), so a fault caught in a user's loop reads exactly as `nandoctor probe` would put
it. Only the detection-only case (no `step_fn`, so no replay is possible) is worded here. The folder
holds report.json, report.md, plots/, batch.npz, state.npz, rng_state.json, environment.json and a
README: the bundle's inert files (there is no spec, so no spec.yaml, code/ or reproduce.py).
"""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from nandoctor import env
from nandoctor.advice import advice_for
from nandoctor.artifacts import capture
from nandoctor.findings import Code, Finding, Location, Phase, Report, Severity
from nandoctor.probe.loop import LoopResult
from nandoctor.probe.watcher import Fault, FaultKind

log = logging.getLogger("nandoctor")


def new_report(device: str, mode: str) -> Report:
    report = Report(command="probe", run={"mode": mode, "device": device})
    report.environment = env.collect()
    report.environment["device"] = device
    return report


def fill_report(report: Report, watcher: Any, fault: Fault | None, steps_run: int, *, workload: Any,
                optimizer: Any) -> None:
    """Timeline, per-layer details, the fault's findings (by replay when `workload` can replay) and warnings."""
    from nandoctor.probe import _details, _handle_fault, _timeline

    res = LoopResult(records=list(watcher.records), fault=fault, steps_run=steps_run,
                     stats_every=list(watcher.stats_every))
    _timeline(report, res)
    _details(report, res, SimpleNamespace(monitor=watcher.monitor))
    report.run["steps_run"] = steps_run
    if fault is not None:
        if fault.kind == FaultKind.NONFINITE and workload.compute_loss is None:
            detection_only(report, fault, workload.model)
        else:
            _handle_fault(report, res, workload, optimizer, SimpleNamespace(watcher=watcher))
    report.findings += watcher.warnings(fault)


def detection_only(report: Report, fault: Fault, model: Any) -> None:
    """No step_fn: what the step's numbers say (loss or gradient, the first parameter whose gradient is
    non-finite), and how to get the rest."""
    import paddle

    from nandoctor.probe import faults
    from nandoctor.probe.monitors import float_dtypes

    st = fault.stats
    loss_ok = st is not None and math.isfinite(st.loss)
    bad = [n for n, p in model.named_parameters()
           if p.grad is not None and p.grad.dtype in float_dtypes() and not bool(paddle.isfinite(p.grad).all())]
    phase = Phase.BACKWARD if loss_ok else Phase.LOSS
    code = Code.GRAD_NONFINITE if loss_ok else Code.LOSS_NONFINITE
    loc = Location(step=fault.step, phase=phase, parameter=bad[0] if bad and loss_ok else None,
                   batch_index=fault.batch_index)
    what = (f"A gradient became NaN/Inf at step {fault.step} while the loss was finite ({st.loss:.4g})"
            + (f"; first non-finite parameter gradient: {bad[0]}" if bad else "") if loss_ok else
            f"The loss became NaN/Inf at step {fault.step}")
    what += (". Pass step_fn=(model, batch) -> loss to nandoctor.watch to have the step replayed for the layer, "
             "op, source line and samples.")
    report.findings.append(Finding(code, Severity.ERROR, what, loc,
                                   {"loss": st.loss if st else None, "grad_norm": st.grad_norm if st else None,
                                    "nonfinite_grad_parameters": bad[:50], "localised": False},
                                   advice_for(code.value)))
    faults.set_first(report, loc)
    if fault.fields:
        capture(report, fault.fields, step=fault.step, batch_index=fault.batch_index, model=model, rng=fault.rng)


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
