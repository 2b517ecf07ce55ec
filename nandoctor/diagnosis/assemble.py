"""What an in-loop watch found -> the probe's Report, and that report written to `report_dir`.

The findings come from the probe's own diagnosis (`nandoctor.diagnosis.diagnose`: the replay, the sample
bisection, the wording), so a fault caught in a user's loop reads exactly as `nandoctor probe` would put
it. The folder
holds report.json, report.md, plots/, batch.npz, state.npz, rng_state.json, environment.json and a
README: the bundle's inert files (there is no spec, so no spec.yaml, code/ or reproduce.py).
"""

from __future__ import annotations

import logging
from typing import Any

from nandoctor import env
from nandoctor.diagnosis.diagnose import StepTarget, diagnose, record_run
from nandoctor.engine.watcher import Fault
from nandoctor.findings import Mode, Report

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
    from nandoctor.diagnosis import nan_params

    records = list(watcher.records)
    record_run(report, records, watcher.monitor, steps_run=steps_run, stats_every=list(watcher.stats_every))
    if start_bad:
        nan_params.before_training(report, start_bad, can_stop=False)
    diagnose(report, fault, target, optimizer)
    if start_bad:
        nan_params.after_run(report, start_bad, fault, target, steps_run, records)
    report.findings += watcher.warnings(fault)
    from nandoctor.diagnosis import causes
    from nandoctor.engine.watcher import current_lr

    # the probe's own causes and advice (the growth before the fault, the data's scale), in the user's mode
    label = target.label_name(fault.fields) if fault is not None and fault.fields else None
    causes.explain(report, fault, records, current_lr(optimizer), label=label)


