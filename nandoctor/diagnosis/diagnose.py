"""The one path from a detected fault to the report's findings, for every way in.

`nandoctor probe`, `nandoctor run`, `nandoctor.watch`, the hapi and Trainer callbacks and the ranks of
`--nproc` all detect with the same `StepWatcher` and all come here with a `StepTarget`: what the
diagnosis reads of a workload (the model, how to replay one step's loss, where the user's code lives,
how to name the loss and the data in a message). Nothing here knows a spec: a spec-driven workload
makes its target in `Workload.target()`, an in-loop watch from the user's `step_fn`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from nandoctor.diagnosis import faults
from nandoctor.diagnosis.crash import CrashContext, crash_findings
from nandoctor.diagnosis.trainability import loss_finding, loss_source
from nandoctor.engine.artifacts import capture
from nandoctor.engine.sandbox import redirected
from nandoctor.engine.watcher import RECENT_STEPS, Fault, FaultKind
from nandoctor.errors import UserCodeError
from nandoctor.findings import Code, Finding, Location, Mode, Phase, Report, Severity, TimelinePoint

__all__ = ["LossCodeFault", "StepTarget", "diagnose", "note_replay_writes", "record_run", "replaying"]

_MAX_ROWS = 64
_MAX_COLS = 200


@dataclass
class LossCodeFault:
    """A fault that began in the user's loss code, outside the model, where no replay can reach it.

    `nandoctor run` cannot call the user's loss code again: it sees only the model's outputs and the
    gradient that came back to them. `rows` are the samples whose output gradient was non-finite (evidence,
    not causes: a loss that mixes rows spreads one sample's NaN); `op`/`source` are filled when a checked pass
    saw it, and `samples` when that pass bisected the batch through the loss function it caught
    (zero_change/loss_samples.py: {"samples", "scope", "reason", "notes", "function"}, or {"samples": None,
    "why"}); None when no pass ran."""

    phase: Phase  # LOSS: the loss value itself; BACKWARD: a gradient inside the loss code
    rows: list[int] | None
    batch_size: int | None
    op: str | None = None
    source: str | None = None
    notes: list[str] = field(default_factory=list)
    samples: dict[str, Any] | None = None
    no_pass: str | None = None  # why no checked pass bisected the batch, when none did


@dataclass
class StepTarget:
    """What the diagnosis reads of a workload, and nothing more."""

    model: Any
    # (model, fields) -> the step's loss, for replays; None when the step cannot be replayed
    replay_loss: Callable[[Any, dict[str, Any]], Any] | None
    base_dir: Path  # the user's code: source lines are shown relative to it
    mode: Mode = Mode.PROBE
    loss_source: str = "the loss"  # how a message names the loss's code ("loss.entry losses.py:bce")
    data_source: str = "your data"
    label_name: Callable[[dict[str, Any]], str | None] = field(default=lambda fields: None)
    label_bounds: tuple[float, float] | None = None
    # Before any replay: a fault that began in loss code no replay can reach (`nandoctor run`), else None
    loss_code_fault: Callable[[Fault], LossCodeFault | None] | None = None
    # Why the replay failed, in the user's terms, when it was tried and could not run (replay_loss is then None)
    replay_failed: str | None = None
    # The user's line that called the model in the failing step, for a replay that calls it from nandoctor's
    # own code (`nandoctor run`): the op's user line when no line of the user's runs inside the replay
    # (file, line, function)
    model_caller: Callable[[], tuple[str, int, str] | None] | None = None


def spec_target(workload: Any) -> StepTarget:
    """What the diagnosis of a fault reads of a spec's workload."""
    spec = workload.spec
    return StepTarget(model=workload.model, replay_loss=workload.compute_loss, base_dir=spec.base_dir,
                      mode=Mode.PROBE, loss_source=loss_source(spec, workload.uses_step),
                      data_source=f"data.entry {spec.data.entry}", label_name=workload.layout.label_name,
                      label_bounds=spec.checks.label_bounds())


def diagnose(report: Report, fault: Fault | None, target: StepTarget, optimizer: Any) -> None:
    """The fault's findings and first_fault, and the material a bundle needs, added to `report`."""
    if fault is None:
        return
    model = target.model
    kind = fault.kind
    if kind == FaultKind.DATA:
        faults.data_fault(report, fault)
        if fault.fields is not None:
            capture(report, fault.fields, step=fault.step, batch_index=fault.batch_index, model=model)
    elif kind == FaultKind.UPDATE:
        faults.update_fault(report, fault, optimizer)
        if fault.fields is not None:  # the step already ran: the batch for --bundle, but no pre-step state
            capture(report, fault.fields, step=fault.step, batch_index=fault.batch_index)
    elif kind == FaultKind.LOSS:
        finding = loss_finding(fault, target.loss_source)
        if target.mode != Mode.PROBE and fault.code == Code.LOSS_NO_GRAD and fault.phase == Phase.BACKWARD:
            # in a user's own loop the same picture comes from checking before backward() ran
            finding.message += (" If your loop calls check() before loss.backward(), move it after: no gradient "
                                "exists yet at that point.")
        report.findings.append(finding)
        report.crashed = True  # training cannot go on with such a loss
        faults.set_first(report, Location(step=fault.step, phase=fault.phase, batch_index=fault.batch_index))
    elif kind == FaultKind.CRASH:
        _crash(report, fault, target)
    else:
        outside = target.loss_code_fault(fault) if target.loss_code_fault is not None else None
        if outside is None and target.replay_loss is not None:
            with replaying(report, target.base_dir, f"the replays of step {fault.step}"):
                _localise(report, fault, target)
            return
        if outside is not None:
            faults.loss_code_fault(report, fault, outside, target.mode.value)
        else:
            faults.detection_only(report, fault, model, target.mode.value, target.replay_failed)
        if fault.fields:
            capture(report, fault.fields, step=fault.step, batch_index=fault.batch_index, model=model,
                    rng=fault.rng)


@contextlib.contextmanager
def replaying(report: Report, folder: Path, what: str) -> Iterator[None]:
    """The block re-runs the user's code (`what`): its writes go to a private folder (sandbox.py), and the
    files of `folder` that changed all the same are named in the report afterwards."""
    with redirected(folder) as changed:
        yield
    note_replay_writes(report, changed, what)


def note_replay_writes(report: Report, changed: list[str], what: str) -> None:
    """Files of the user's folder that changed while nandoctor re-ran their code, despite the write
    redirect (a file their code opened before, C code's own I/O): named, so nobody trusts them blindly."""
    if not changed:
        return
    shown = ", ".join(changed[:10]) + ("…" if len(changed) > 10 else "")
    report.details.setdefault("replay_changed_files", []).extend(changed[:100])
    report.findings.append(Finding(
        Code.REPLAY_SIDE_EFFECTS, Severity.WARNING,
        f"{what[:1].upper()}{what[1:]} ran your code again, and it changed {len(changed)} file(s) in its folder "
        f"that nandoctor could not redirect (written through a file opened before the replay, such as a log "
        f"handler's, or by C code): {shown}. Check them: they may hold a replay's output, not your run's.",
        Location(), {"files": changed[:100]},
        ["Open log files and checkpoints by path at each write (nandoctor redirects those), or compare the "
         "files named here with a backup."]))


def _crash(report: Report, fault: Fault, target: StepTarget) -> None:
    exc = fault.exc
    what = {Phase.DATA: target.data_source, Phase.FORWARD: "the model's forward pass or loss",
            Phase.BACKWARD: "loss.backward()", Phase.LOSS: f"the loss from {target.loss_source}",
            Phase.OPTIMIZER: "optimizer.step()"}.get(fault.phase, "your code")
    if isinstance(exc, UserCodeError):
        what, exc = exc.what, exc.exc
    ctx = CrashContext(step=fault.step, batch_index=fault.batch_index, epoch=fault.epoch,
                       phase=fault.phase or Phase.FORWARD, what=what)
    model = target.model
    layer_ids = {id(model): "", **{id(layer): name for name, layer in model.named_sublayers()}}
    fields = fault.fields
    label_name = target.label_name(fields) if fields is not None else None
    found, loc = crash_findings(exc, ctx, target.base_dir, model, layer_ids, fields, label_name, target.label_bounds)
    report.findings += found
    report.crashed = True
    faults.set_first(report, loc)
    if fields is not None:
        capture(report, fields, step=fault.step, batch_index=fault.batch_index, model=model)


def _localise(report: Report, fault: Fault, target: StepTarget) -> None:
    import time

    from nandoctor.diagnosis.localize import localize
    from nandoctor.diagnosis.samples import find_samples

    model = target.model
    st = fault.stats
    t0 = time.perf_counter()
    capture(report, fault.fields, step=fault.step, batch_index=fault.batch_index, model=model, rng=fault.rng)
    loc, replayer = localize(target, fault.fields, fault.rng, math.isfinite(st.loss))
    try:
        bis = find_samples(replayer, fault.fields, loc.phase.value)
    finally:
        replayer.restore()
    notes = list(bis.notes)
    if any(isinstance(layer, (_bn_types())) for _, layer in model.named_sublayers()):
        notes.append("the model has batch-norm layers, kept in train mode for the replays (the failing "
                     "condition); subsets see different batch statistics")
    report.details["bisection"] = {"evaluations": bis.evaluations, "capped": bis.capped}
    report.details["localization_seconds"] = round(time.perf_counter() - t0, 3)
    faults.nonfinite_fault(report, fault, loc, bis.samples, notes, bis.scope, bis.reason)


def _bn_types() -> tuple[type, ...]:
    import paddle

    return (paddle.nn.BatchNorm1D, paddle.nn.BatchNorm2D, paddle.nn.BatchNorm3D, paddle.nn.BatchNorm)


def record_run(report: Report, records: list[Any], monitor: Any, *, steps_run: int, epochs: int = 1,
               stats_every: list[int] | None = None) -> None:
    """The timeline and the per-layer matrices of a run, whoever drove it."""
    report.timeline = [TimelinePoint(step=r.step, loss=r.loss, grad_norm=r.grad_norm, loss_scale=r.loss_scale,
                                     skipped=r.skipped, lr=r.lr) for r in records]
    report.details["steps_run"] = steps_run
    report.details["epochs"] = epochs
    if len(records) < steps_run:  # a long run's older steps were thinned (watcher._record): say so
        report.details["timeline_thinned"] = {"steps_kept": len(records), "steps_run": steps_run,
                                              "recent_in_full": min(steps_run, RECENT_STEPS)}
    report.run["steps_run"] = steps_run
    if stats_every:
        report.details["stats_every"] = stats_every[-1]
    if monitor is None:
        return
    act = [(r.step, r.act_max) for r in records if r.act_max is not None]
    if act and monitor.layer_names:
        report.details["activation_max"] = _matrix(monitor.layer_names, act, "layers")
    grads = [(r.step, np.sqrt(r.grad_sq)) for r in records if r.grad_sq is not None]
    if grads and monitor.param_names:
        report.details["grad_norms"] = _matrix(monitor.param_names, grads, "parameters")


def _matrix(names: list[str], cols: list[tuple[int, np.ndarray]], key: str) -> dict[str, Any]:
    """{key: names, steps, values[row][col]}: at most ~200 steps (evenly, keeping the last) and 64 rows
    (the largest by max value)."""
    if len(cols) > _MAX_COLS:
        keep = sorted(set(np.linspace(0, len(cols) - 1, _MAX_COLS).round().astype(int).tolist()))
        cols = [cols[i] for i in keep]
    mat = np.stack([c for _, c in cols], axis=1)  # rows x steps
    rows = list(range(len(names)))
    if len(rows) > _MAX_ROWS:
        with np.errstate(all="ignore"):
            score = np.nan_to_num(np.nanmax(np.where(np.isnan(mat), -np.inf, mat), axis=1), nan=-np.inf,
                                  posinf=np.finfo("float64").max)
        rows = sorted(np.argsort(-score, kind="stable")[:_MAX_ROWS].tolist())
    values = [[None if np.isnan(v) else float(v) for v in mat[i]] for i in rows]
    return {key: [names[i] for i in rows], "steps": [s for s, _ in cols], "values": values}
