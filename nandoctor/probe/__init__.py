"""A short instrumented training run that detects cheaply and localises the first fault by replay.

`run_probe` owns the order of work: seed, build the workload and optimizer, check the parameters,
run the loop (loop.py), and turn what stopped it into findings: a replay for a non-finite value
(localize.py, samples.py), a translation for a crash (crash.py), warnings (warnings.py). The model's
hooks, Paddle's tensor checker and the train/eval mode are always restored before returning.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from nandoctor import env
from nandoctor.advice import advice_for
from nandoctor.diagnosis import causes, faults
from nandoctor.diagnosis.assemble import RunFacts, assemble
from nandoctor.diagnosis.crash import CrashContext, crash_findings
from nandoctor.diagnosis.diagnose import replaying, spec_target
from nandoctor.diagnosis.trainability import no_trainable_finding
from nandoctor.engine.artifacts import WANTED, capture
from nandoctor.engine.checker import disable_checker
from nandoctor.engine.interrupt import interrupted_finding, reassert
from nandoctor.engine.loop import LoopResult, ProbeLoop
from nandoctor.engine.step import StepEngine
from nandoctor.engine.watcher import FaultKind, current_lr, trainable_names
from nandoctor.errors import UserCodeError
from nandoctor.findings import Code, Finding, Location, Phase, Report, Severity
from nandoctor.progress import ProgressFn, no_progress
from nandoctor.spec import Spec
from nandoctor.tensors.device import resolve_device, use_device
from nandoctor.workload.build import build_optimizer, build_workload
from nandoctor.workload.resume import resume_probe

__all__ = ["ProbeOptions", "run_probe"]


@dataclass
class ProbeOptions:
    steps: int = 200
    seed: int = 0
    device: str = "auto"
    try_fixes: bool = True  # after a fault, replay candidate remedies (remedies/trial.py)
    fix_steps: int = 20  # remedies replay to the fault step + this many steps
    bundle: bool = True  # a bundle will be written: keep a copy of the fault's batch and state (artifacts.py)


def run_probe(spec: Spec, options: ProbeOptions, progress: ProgressFn = no_progress) -> Report:
    """Train for up to `options.steps` steps and report the first fault; SpecError propagates (exit 2)."""
    import paddle

    device = resolve_device(options.device)
    report = Report(command="probe", run={"steps": options.steps, "seed": options.seed, "device": device,
                                          "amp": spec.amp.enabled})
    report.environment = env.collect()
    report.environment["device"] = device
    if not options.bundle:
        report.artifacts[WANTED] = False  # no bundle: no copy of the fault's batch and model state
    use_device(device)
    paddle.seed(options.seed)
    np.random.seed(options.seed % 2**32)
    random.seed(options.seed)
    try:
        _probe(spec, options, progress, report, device)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM at any moment: model build, loader workers, replay
        _interrupted(report, int(report.details.get("steps_run", len(report.timeline))))
    return report


def _interrupted(report: Report, steps_run: int) -> None:
    if report.partial:
        return
    report.partial = True
    report.findings.append(interrupted_finding("probe", f"{steps_run} step(s)", step=steps_run))


def _probe(spec: Spec, options: ProbeOptions, progress: ProgressFn, report: Report, device: str) -> None:
    """Build, check the starting parameters, train; each step that finds a reason to stop says so in `report`."""
    import time

    t_start = time.perf_counter()
    progress(0, options.steps, "building the model")
    workload = _built(spec, report)
    if workload is None:
        return
    reassert()  # the user's imports (paddleformers) may have reset SIGTERM in C: a signal must still report
    model = workload.model
    if not trainable_names(model):
        report.findings.append(no_trainable_finding(spec, model))
        report.crashed = True
        report.details["steps_run"] = 0
        return
    optimizer = build_optimizer(spec, model)
    start_step = resume_probe(spec, model, optimizer, report)  # 0 unless resuming from the user's checkpoint
    report.details["clip"] = _clip(spec)
    _note_amp(report, spec, device)
    workload = workload.on_device(device)  # autocast under AMP on a GPU, for the loop and every replay
    found_causes = causes.before_training(report, model, optimizer)
    if found_causes.stop:
        report.details["steps_run"] = 0
        capture(report, {}, step=None, batch_index=None, model=model)
        return
    _train(_Run(spec, options, progress, report, device, workload, optimizer, found_causes, start_step, t_start))


@dataclass
class _Run:
    """One probe's settings and what it built, handed from step to step of `_train`."""

    spec: Spec
    options: ProbeOptions
    progress: ProgressFn
    report: Report
    device: str
    workload: Any
    optimizer: Any
    causes: causes.Causes
    start_step: int
    t_start: float


def _built(spec: Spec, report: Report) -> Any:
    """The spec's workload, or None when the user's model or data code raised (then a finding says so)."""
    try:
        try:
            return build_workload(spec)
        except SystemExit as exc:  # sys.exit() in the user's module or factory: a finding, not a silent exit
            raise UserCodeError(f"model.entry {spec.model.entry}", exc) from None
    except UserCodeError as err:
        ctx = CrashContext(step=0, batch_index=None, epoch=0, phase=Phase.PARAMS, what=err.what)
        found, loc = crash_findings(err.exc, ctx, spec.base_dir, None, {}, None, None, None)
        report.findings += found
        report.crashed = True
        loc.step = None
        faults.set_first(report, loc)
        return None


def _note_amp(report: Report, spec: Spec, device: str) -> None:
    """AMP's settings in `run`, and a note when the device runs it as float32 (CPU)."""
    if spec.amp.enabled:
        report.run["amp_dtype"] = spec.amp.dtype
        report.run["amp_level"] = spec.amp.level
        if device == "cpu":
            faults.amp_inactive(report, spec.amp.dtype)


def _train(run: _Run) -> None:
    """The instrumented loop, then the report's findings and the remedies; the model's mode, hooks, checker
    and snapshot files are restored or removed whatever stopped it, our own failure included."""
    import time

    spec, report, workload, optimizer = run.spec, run.report, run.workload, run.optimizer
    model = workload.model
    was_training = model.training
    model.train()
    engine = StepEngine.for_workload(workload, optimizer, device=run.device)
    loop: ProbeLoop | None = None
    try:
        loop = ProbeLoop(workload, engine, run.options.steps, run.progress, fp16=spec.amp.enabled and
                         spec.amp.dtype == "float16", amp=spec.amp.enabled, start_nonfinite=run.causes.nonfinite,
                         start_step=run.start_step)
        if run.options.try_fixes:
            from nandoctor.engine.snapshots import SnapshotRing

            loop.snapshots = SnapshotRing.for_model(model, optimizer)
            _keep_batches(loop)
        res = loop.run()
        _after_loop(report, res, loop, workload, optimizer)
        assemble(report, RunFacts(
            loop.watcher, res.steps_run, res.fault, spec_target(workload), optimizer, run.causes,
            records=res.records, epochs=res.epochs, stats_every=res.stats_every, lr=current_lr(optimizer),
            label=spec.data.label, optimizer_spec=spec.optimizer,
            init_loss_scale=spec.amp.init_loss_scaling if engine.scaler is not None else None))
        if res.steps_run == 0 and res.fault is None and not res.interrupted:
            report.findings.append(_empty_data(spec))
        if res.interrupted:
            _interrupted(report, res.steps_run)
        elif loop.snapshots is not None and (res.fault is not None or _diverged(report)):
            _remedies(report, res, workload, optimizer, loop, run.options, run.device,
                      time.perf_counter() - run.t_start, run.progress)
    finally:
        _close(loop)
        disable_checker()
        if not was_training:
            model.eval()


def _after_loop(report: Report, res: LoopResult, loop: ProbeLoop, workload: Any, optimizer: Any) -> None:
    """What the loop left to settle before the diagnosis: the snapshots' summary, a rollback to the step
    where the fault began when its gradients went unread, and an update fault's batch for the bundle."""
    from nandoctor.engine import rollback

    base_dir = workload.spec.base_dir
    if loop.snapshots is not None:
        report.details["snapshots"] = loop.snapshots.summary()
    if res.fault is not None and res.fault.unread and rollback.needs_rollback(res.fault, loop.snapshots):
        with replaying(report, base_dir, "the rollback's replay of the unread steps"):
            report.details["rollback"] = rollback.rollback(res, workload, optimizer, loop.snapshots)
    if _bundle_needs_batch(report, res):  # the watcher kept the update's position, not its batch
        with replaying(report, base_dir, "the re-read of the update fault's batch for the bundle"):
            res.fault.fields = rollback.read_batch(workload, loop.snapshots, res.fault.epoch, res.fault.batch_index)


def _empty_data(spec: Spec) -> Finding:
    return Finding(
        Code.DATA_EMPTY, Severity.ERROR,
        f"data.entry {spec.data.entry} yielded no batch at all, so the probe trained nothing. Check the "
        "dataset path and size, and `drop_last` with a batch size larger than the dataset.",
        Location(phase=Phase.DATA, batch_index=0), {}, advice_for(Code.DATA_EMPTY.value))


def _close(loop: ProbeLoop | None) -> None:
    """The loop's hooks off, and the loaders and spilled snapshots the replays left open closed."""
    if loop is None:
        return
    loop.close()
    if loop.snapshots is not None and loop.snapshots.batches is not None:
        loop.snapshots.batches.close()  # the loaders the replays left open for each other
    if loop.snapshots is not None:
        loop.snapshots.close()  # the spilled snapshots' folder, whatever stopped the run


def _bundle_needs_batch(report: Report, res: LoopResult) -> bool:
    """An update fault without its batch (the watcher kept its position: ProbeLoop.run), when a bundle will
    be written: its batch.npz is the one thing an update fault's batch serves."""
    fault = res.fault
    return (fault is not None and fault.kind == FaultKind.UPDATE and fault.fields is None and not res.interrupted
            and fault.batch_index is not None and report.artifacts.get(WANTED) is not False)


def _keep_batches(loop: ProbeLoop) -> None:
    """The loop reads through a tape that keeps its batches, so the replays (rollback, remedies) run on them
    rather than re-reading the user's loader (engine/batch_tape.py)."""
    import dataclasses

    from nandoctor.engine.batch_tape import BatchTape

    if getattr(loop, "start_step", 0):  # a resumed loop is positioned by its own loader: replays re-read it
        return
    tape = loop.snapshots.batches = BatchTape(loop.w.make_loader)
    loop.w = dataclasses.replace(loop.w, make_loader=tape.recording)


def _remedies(report: Report, res: LoopResult, workload: Any, optimizer: Any, loop: ProbeLoop,
              options: ProbeOptions, device: str, probe_seconds: float, progress: ProgressFn = no_progress) -> None:
    """Replay the candidate fixes (hooks detached, the checker off first: replays are plain training): after a
    fault, or for a loss that diverged without one, or (without either) for precursor warnings or a loss spike."""
    from nandoctor.remedies.divergence import try_divergence_remedies
    from nandoctor.remedies.trial import try_remedies

    loop.close()
    disable_checker()
    try:
        with replaying(report, workload.spec.base_dir, "the remedy replays"):
            if res.fault is None:
                try_divergence_remedies(report, res, workload, optimizer, loop.snapshots, probe_seconds=probe_seconds,
                                        amp=workload.spec.amp.enabled, device=device, progress=progress,
                                        precursors=getattr(loop.watcher, "precursors", None))
            else:
                try_remedies(report, res, workload, optimizer, loop.snapshots, fix_steps=options.fix_steps,
                             probe_seconds=probe_seconds, amp=workload.spec.amp.enabled, device=device,
                             progress=progress)
    except Exception as exc:  # noqa: BLE001 - a bug in our replays must not cost the user the diagnosis
        report.remedies = []
        report.details["remedies"] = {"error": f"nandoctor's own remedy replay failed (a nandoctor bug, not "
                                               f"yours; please report it): {type(exc).__name__}: {exc}"[:400]}


def _diverged(report: Report) -> bool:
    """A run whose loss diverged without a fault, or whose only signs are precursor warnings or a loss spike: its
    step-size remedies are replayed too."""
    from nandoctor.remedies.divergence import diverged, warned

    return diverged(report) is not None or bool(warned(report))


def _clip(spec: Spec) -> float | None:
    clip = spec.optimizer.grad_clip
    return float(clip.value) if clip is not None and clip.kind in ("global_norm", "norm") else None

