"""After a run: the one sequence that turns what a way in saw into the report's findings.

Every way in (the probe, `--nproc`'s ranks, `nandoctor.watch`, `nandoctor run`, the hapi and Trainer
callbacks) calls `assemble` once its run stopped, with the same `RunFacts`, so each gets every check in the
same order: the timeline, the starting parameters' causes (initial scale, NaN/Inf), the fault's own
findings (diagnose.py: the replay, the sample bisection, the wording), the warnings that came before it
(the watcher's, then the loss's own course: loss_trend.py), the causes read back (causes.py), and AMP's
loss-scale collapse. A fault caught in a user's loop therefore reads exactly as `nandoctor probe` would put it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nandoctor import env
from nandoctor.advice import advice_for
from nandoctor.diagnosis import nan_params
from nandoctor.diagnosis.causes import Causes, explain
from nandoctor.diagnosis.diagnose import StepTarget, diagnose, record_run
from nandoctor.diagnosis.loss_trend import loss_findings
from nandoctor.diagnosis.precursor_link import link_precursors
from nandoctor.engine.watcher import Fault, FaultKind
from nandoctor.findings import Code, Finding, Location, Mode, Phase, Report, Severity


@dataclass
class RunFacts:
    """What a way in knows once its run stopped: what `assemble` reads, and nothing more."""

    watcher: Any  # the StepWatcher that detected: its monitor, warnings and (unless given) records
    steps_run: int
    fault: Fault | None
    target: StepTarget
    optimizer: Any
    causes: Causes = field(default_factory=Causes)  # the starting parameters (causes.check_start)
    records: list[Any] | None = None  # None: the watcher's own
    epochs: int = 1
    stats_every: list[int] | None = None  # None: the watcher's own
    lr: float | None = None  # the learning rate at the fault, for the advice's numbers
    label: str | None = None  # the target field's name, when known
    optimizer_spec: Any = None  # a spec's optimizer block (its settings' keys); None outside a spec
    init_loss_scale: float | None = None  # AMP's initial loss scale where a GradScaler ran, else None


def new_report(device: str, mode: Mode) -> Report:
    """An in-loop report; `run.mode` names the way in (its title: `Mode.title`)."""
    report = Report(command="probe", run={"mode": mode.value, "device": device})
    report.environment = env.collect()
    report.environment["device"] = device
    return report


def target_label(target: StepTarget, fault: Fault | None) -> str | None:
    """The target field's name as the workload's own naming gives it for the faulting batch (a user's loop)."""
    return target.label_name(fault.fields) if fault is not None and fault.fields else None


def assemble(report: Report, facts: RunFacts) -> None:
    """The run's timeline and findings added to `report`, in the same order for every way in."""
    watcher, fault, causes = facts.watcher, facts.fault, facts.causes
    records = list(watcher.records) if facts.records is None else facts.records
    stats_every = list(watcher.stats_every) if facts.stats_every is None else facts.stats_every
    record_run(report, records, watcher.monitor, steps_run=facts.steps_run, epochs=facts.epochs,
               stats_every=stats_every)
    if not causes.reported:  # (the probe reports them before training: they may stop it)
        report.findings += causes.init_findings
        if causes.bad:
            nan_params.before_training(report, causes.bad, can_stop=False)
    diagnose(report, fault, facts.target, facts.optimizer)
    report.findings += watcher.warnings(fault)
    loss_warnings(report, records, fault)
    link_precursors(report, fault.step if fault is not None and fault.kind != FaultKind.CRASH else None)
    if causes.bad:
        nan_params.after_run(report, causes.bad, fault, facts.target, facts.steps_run, records)
    explain(report, fault, records, facts.lr, label=facts.label, optimizer=facts.optimizer_spec)
    if facts.init_loss_scale is not None:
        scale_collapse(report, records, facts.init_loss_scale)


def loss_warnings(report: Report, records: list[Any], fault: Fault | None) -> None:
    """The loss's divergence and spikes (up to the fault; the fault's finding is told of a divergence before it
    by link_precursors). Not after a crash: the user's code stopped the run, and its loss says nothing of that."""
    if fault is not None and fault.kind == FaultKind.CRASH:
        return
    report.findings += loss_findings(report, records, fault.step if fault is not None else None)


def scale_collapse(report: Report, records: list[Any], init_scale: float) -> None:
    """AMP's loss scale keeps halving (an overflow on most steps): a warning with the numbers."""
    scales = [(r.step, r.loss_scale) for r in records if r.loss_scale is not None]
    skipped = [r.step for r in records if r.skipped]
    if len(scales) < 5:
        return
    last = scales[-1][1]
    if last < init_scale / 2**10 or len(skipped) > len(scales) / 2:
        report.findings.append(Finding(
            Code.AMP_SCALE_COLLAPSE, Severity.WARNING,
            f"The AMP loss scale fell from {init_scale:g} to {last:g} over {len(scales)} steps, and {len(skipped)} "
            f"step(s) were skipped for overflowing gradients (first at step {skipped[0] if skipped else '-'}).",
            Location(step=skipped[0] if skipped else scales[-1][0], phase=Phase.BACKWARD),
            {"init_scale": init_scale, "final_scale": last, "skipped_steps": skipped[:50]},
            advice_for(Code.AMP_SCALE_COLLAPSE.value)))
