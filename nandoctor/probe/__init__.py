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
from nandoctor.workload import build_optimizer, build_workload
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
    import time

    t_start = time.perf_counter()
    progress(0, options.steps, "building the model")
    try:
        try:
            workload = build_workload(spec)
        except SystemExit as exc:  # sys.exit() in the user's module or factory: a finding, not a silent exit
            raise UserCodeError(f"model.entry {spec.model.entry}", exc) from None
    except UserCodeError as err:
        ctx = CrashContext(step=0, batch_index=None, epoch=0, phase=Phase.PARAMS, what=err.what)
        found, loc = crash_findings(err.exc, ctx, spec.base_dir, None, {}, None, None, None)
        report.findings += found
        report.crashed = True
        loc.step = None
        faults.set_first(report, loc)
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
    fp16 = spec.amp.enabled and spec.amp.dtype == "float16"
    if spec.amp.enabled:
        report.run["amp_dtype"] = spec.amp.dtype
        report.run["amp_level"] = spec.amp.level
        if device == "cpu":
            faults.amp_inactive(report, spec.amp.dtype)
    workload = workload.on_device(device)  # autocast under AMP on a GPU, for the loop and every replay
    found_causes = causes.before_training(report, model, optimizer)
    if found_causes.stop:
        report.details["steps_run"] = 0
        capture(report, {}, step=None, batch_index=None, model=model)
        return
    was_training = model.training
    model.train()
    engine = StepEngine.for_workload(workload, optimizer, device=device)
    scaler = engine.scaler
    loop: ProbeLoop | None = None
    try:
        loop = ProbeLoop(workload, engine, options.steps, progress, fp16=fp16, amp=spec.amp.enabled,
                         start_nonfinite=found_causes.nonfinite, start_step=start_step)
        if options.try_fixes:
            from nandoctor.engine.snapshots import SnapshotRing

            loop.snapshots = SnapshotRing.for_model(model, optimizer)
            _keep_batches(loop)
        res = loop.run()
        if loop.snapshots is not None:
            report.details["snapshots"] = loop.snapshots.summary()
        if res.fault is not None and res.fault.unread:  # gradients went unread where the fault began
            from nandoctor.engine import rollback

            if rollback.needs_rollback(res.fault, loop.snapshots):
                with replaying(report, spec.base_dir, "the rollback's replay of the unread steps"):
                    report.details["rollback"] = rollback.rollback(res, workload, optimizer, loop.snapshots)
        if _bundle_needs_batch(report, res):  # the watcher kept the update's position, not its batch
            from nandoctor.engine import rollback

            with replaying(report, spec.base_dir, "the re-read of the update fault's batch for the bundle"):
                res.fault.fields = rollback.read_batch(workload, loop.snapshots, res.fault.epoch,
                                                       res.fault.batch_index)
        assemble(report, RunFacts(
            loop.watcher, res.steps_run, res.fault, spec_target(workload), optimizer, found_causes,
            records=res.records, epochs=res.epochs, stats_every=res.stats_every, lr=current_lr(optimizer),
            label=spec.data.label, optimizer_spec=spec.optimizer,
            init_loss_scale=spec.amp.init_loss_scaling if scaler is not None else None))
        if res.steps_run == 0 and res.fault is None and not res.interrupted:
            report.findings.append(Finding(
                Code.DATA_EMPTY, Severity.ERROR,
                f"data.entry {spec.data.entry} yielded no batch at all, so the probe trained nothing. Check the "
                "dataset path and size, and `drop_last` with a batch size larger than the dataset.",
                Location(phase=Phase.DATA, batch_index=0), {}, advice_for(Code.DATA_EMPTY.value)))
        if res.interrupted:
            _interrupted(report, res.steps_run)
        elif loop.snapshots is not None and res.fault is not None:
            _remedies(report, res, workload, optimizer, loop, options, device, time.perf_counter() - t_start,
                      progress)
    finally:  # hooks, checker and mode restored whatever stopped the run, our own failure included
        if loop is not None:
            loop.close()
            if loop.snapshots is not None and loop.snapshots.batches is not None:
                loop.snapshots.batches.close()  # the loaders the replays left open for each other
            if loop.snapshots is not None:
                loop.snapshots.close()  # the spilled snapshots' folder, whatever stopped the run
        disable_checker()
        if not was_training:
            model.eval()


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
    """Replay the candidate fixes (hooks detached, the checker off first: replays are plain training)."""
    from nandoctor.remedies.trial import try_remedies

    loop.close()
    disable_checker()
    try:
        with replaying(report, workload.spec.base_dir, "the remedy replays"):
            try_remedies(report, res, workload, optimizer, loop.snapshots, fix_steps=options.fix_steps,
                         probe_seconds=probe_seconds, amp=workload.spec.amp.enabled, device=device,
                         progress=progress)
    except Exception as exc:  # noqa: BLE001 - a bug in our replays must not cost the user the diagnosis
        report.remedies = []
        report.details["remedies"] = {"error": f"nandoctor's own remedy replay failed (a nandoctor bug, not "
                                               f"yours; please report it): {type(exc).__name__}: {exc}"[:400]}


def _clip(spec: Spec) -> float | None:
    clip = spec.optimizer.grad_clip
    return float(clip.value) if clip is not None and clip.kind in ("global_norm", "norm") else None

