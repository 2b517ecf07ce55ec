"""The probe's training loop: the user's calls in order, each behind the boundary that makes its
exception a finding; everything nandoctor does per step is the watcher's (watcher.py).

Only the user's own calls sit inside that boundary: `iter()`/`next()` on the loader, the forward and
loss (`Workload.compute_loss`), `backward`, `optimizer.step`/`clear_grad` and the scheduler's step. An
exception anywhere else is nandoctor's own and propagates (the CLI reports it as an internal error),
so a bug of ours is never blamed on the user's optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable

from nandoctor.engine.interrupt import reassert, stop_loader
from nandoctor.engine.snapshots import MIN_EVERY
from nandoctor.engine.step import StepEngine
from nandoctor.engine.watcher import Fault, FaultKind, StatsSchedule, StepRecord, StepWatcher, current_lr
from nandoctor.errors import NandoctorError, UserCodeError
from nandoctor.findings import Phase
from nandoctor.workload import Workload

__all__ = ["Fault", "FaultKind", "LoopResult", "ProbeLoop", "StatsSchedule", "StepRecord", "UserRaised", "user_call"]

# With a snapshot ring, a many-tensor model's gradients are read one step in this many. No more than the
# ring's shortest interval: a fault on an unread step is then always after a snapshot the ring still holds
# (it keeps the last two), so the rollback can replay it.
DEFER_EVERY = MIN_EVERY


@dataclass
class LoopResult:
    records: list[StepRecord] = field(default_factory=list)
    fault: Fault | None = None
    interrupted: bool = False
    steps_run: int = 0
    epochs: int = 1
    stats_every: list[int] = field(default_factory=list)
    start_step: int = 0  # a resumed run's first step (steps_run counts from it)


class UserRaised(Exception):
    """The user's call raised `exc` (SystemExit included) in `phase`; carries it out of `user_call`."""

    def __init__(self, exc: BaseException, phase: Phase) -> None:
        super().__init__(str(exc))
        self.exc = exc
        self.phase = phase


def user_call(phase: Phase, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Any:
    """Call the user's code: its exception (or sys.exit) becomes `UserRaised`; ours and Ctrl-C pass through.
    `what` names the call in the finding when the phase alone would not (the LR scheduler's step)."""
    try:
        return fn(*args)
    except NandoctorError:  # a spec mistake found while calling (a loader that is not iterable): exit 2
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code raised: that is the finding
        if isinstance(exc, StopIteration):
            exc = RuntimeError("the data iterator raised StopIteration from inside a batch")
        raise UserRaised(UserCodeError(what, exc) if what else exc, phase) from None


class ProbeLoop:
    """Runs up to `steps` steps of the user's training; stops at the first fault, crash or Ctrl-C."""

    def __init__(self, workload: Workload, engine: StepEngine, steps: int, progress: Any, *, fp16: bool = False,
                 amp: bool = False, start_nonfinite: list[str] | None = None, start_step: int = 0) -> None:
        self.w = workload
        # Each of the user's calls inside the engine's step goes through `user_call`, the loop's boundary. One
        # optimizer step per `accumulate` batches; a probe step stays one batch, so steps name batches.
        self.engine = engine.with_boundary(user_call)
        self.opt = engine.optimizer
        self.steps = steps
        self.progress = progress
        self.watcher = StepWatcher(workload.model, engine.optimizer, scaler=engine.scaler, fp16=fp16, amp=amp,
                                   start_nonfinite=start_nonfinite)
        self.snapshots: Any = None  # a SnapshotRing (engine/snapshots.py) when remedies will be tried
        # resumed from the user's checkpoint after this many batches: steps are numbered on from it
        self.start_step = start_step

    @property
    def monitor(self) -> Any:
        return self.watcher.monitor

    def run(self) -> LoopResult:
        res = LoopResult(start_step=self.start_step)
        watch = self.watcher
        engine = self.engine
        epoch, batch_index, step = 0, 0, self.start_step
        first_epoch, end = 0, self.start_step + self.steps
        it: Any = None
        fields: dict[str, Any] | None = None
        ring = self.snapshots
        # bound once: a 0.3 ms step pays for the calls, not for looking them up
        name_fields, progress, total, start = self.w.layout.fields, self.progress, self.steps, self.start_step
        opt = self.opt
        # Quiet steps (StepWatcher.quiet_until): before `quiet_until` a step is unread, without stats and
        # without a snapshot; the loop runs the user's calls and notes the step, and the watcher and the ring
        # catch up at the window's end (`settle`). Only with one update per batch.
        quiet: list[list[Any]] = []
        # the batches the watcher may keep of a window: its newest, and its first when nothing is older (issue 22:
        # a window of 16 MB batches held whole was +68 MB on wide_batch)
        quiet_fields: list[dict[str, Any] | None] = []
        quiet_until, in_quiet = 0, False
        can_quiet = False
        if ring is not None and ring.disabled is None:
            # a fault on a step whose gradients (or whole read) went unread can be replayed from the ring
            # (rollback.py), as long as no more steps go unread in a row than the ring's interval
            watch.defer_grads(DEFER_EVERY)
            watch.defer_reads(ring)
            can_quiet = engine.accumulate == 1
            if ring.batches is not None:  # an update fault's batch is read back from the tape (read_batch)
                watch.keep_update_batches = False

        def settle() -> None:
            if quiet:
                watch.quiet_steps(quiet, quiet_fields)
                quiet.clear()
                quiet_fields.clear()

        try:
            if self.start_step:  # the loader past the batches trained before the checkpoint (workload.py)
                epoch, batch_index, it = user_call(Phase.DATA, self.w.resume_at, self.start_step, self._on_epoch)
                first_epoch = epoch
                reassert()
            while step < end:
                fields = None
                if it is None:
                    if ring is not None:
                        ring.on_epoch(epoch)
                    it = user_call(Phase.DATA, lambda: iter(self.w.make_loader()))
                    reassert()  # the data entry's imports may have reset SIGTERM in C (once an epoch)
                batch = _next(it)
                if batch is _END:
                    if batch_index == 0:  # an empty loader: nothing to train on
                        break
                    engine.end_epoch()
                    epoch, batch_index, it = epoch + 1, 0, None
                    res.epochs = epoch + 1 - first_epoch
                    continue
                fields = name_fields(batch, batch_index)
                loss = None
                if step < quiet_until:
                    in_quiet, began = True, perf_counter()
                    loss = engine.loss(fields)
                    if watch.usual_loss(loss):
                        engine.backward(loss)
                        engine.update()
                        # detached: the loss would keep its step's autograd graph alive until the read
                        quiet.append([step, batch_index, epoch, loss.detach(), current_lr(opt), began, perf_counter()])
                        if quiet_fields and (len(quiet_fields) > 1 or watch.history or not watch.keep_update_batches):
                            quiet_fields[-1] = None
                        quiet_fields.append(fields)
                        in_quiet = False
                        step += 1
                        batch_index += 1
                        res.steps_run = step - start
                        if step >= quiet_until:
                            settle()
                        progress(res.steps_run, total, "probe step")
                        continue
                    in_quiet = False
                    settle()  # a loss that cannot train: the watcher's stages name it
                    quiet_until = 0
                if ring is not None:
                    ring.on_batch(step, epoch, batch_index)
                watch.begin_step(step, fields, batch_index=batch_index, epoch=epoch)
                if loss is None:
                    loss = engine.loss(fields)
                res.fault = watch.observe_loss(loss)
                if res.fault is not None:
                    break
                engine.backward(loss)
                res.fault = watch.after_backward(loss)
                if res.fault is not None:
                    break
                stepped = engine.updates_after(step)
                if stepped:
                    engine.update()
                watch.after_update(stepped=stepped)
                step += 1
                batch_index += 1
                if can_quiet:
                    quiet_until = watch.quiet_until(step)
                res.steps_run = step - start
                progress(res.steps_run, total, "probe step")
            settle()
            if res.fault is None:
                res.fault = watch.finish()
        except UserRaised as raised:
            settle()
            if in_quiet:  # raised in a quiet step: the watcher begins it, as it would have before its forward
                watch.begin_step(step, fields or {}, batch_index=batch_index, epoch=epoch)
            # a NaN in the batch that made the model's code raise is the data's fault, named as such; a
            # non-finite loss on an earlier, unread step came first
            bad_data = watch.data_fault(raised.exc) if fields is not None and raised.phase in _STEP_PHASES else None
            res.fault = watch.flush() or bad_data or Fault(FaultKind.CRASH, step, batch_index, epoch,
                                          fields if raised.phase != Phase.DATA else None, exc=raised.exc,
                                          phase=raised.phase)
        except KeyboardInterrupt:
            settle()
            res.interrupted = True
            # the unread steps' records for the partial report; a fault among them is not replayed after Ctrl-C
            watch.flush()
        finally:
            watch.monitor.begin_step(False)  # detach the stats hooks before any replay
            stop_loader(it)
            self.release_batches()  # the fault holds its own batch: the replays after the loop read theirs
        res.records = watch.records
        res.stats_every = watch.stats_every
        return res

    def _on_epoch(self, epoch: int) -> None:
        if self.snapshots is not None:
            self.snapshots.on_epoch(epoch)

    def release_batches(self) -> None:
        """Let go of the batches the watcher and the step engine still hold (issue 22): after the loop they
        would stay alive through the localisation and every replay, beside the batch each replay reads."""
        self.watcher.release_batches()
        self.engine.fields = None

    def close(self) -> None:
        self.watcher.close()
        self.release_batches()


_END = object()
_STEP_PHASES = (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD)


def _next(it: Any) -> Any:
    """`next(it)` behind the boundary (as `user_call(Phase.DATA, ...)`, one call less a step), with the loader's
    normal end as a sentinel rather than StopIteration."""
    try:
        return next(it)
    except StopIteration:
        return _END
    except NandoctorError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's loader raised: that is the finding
        raise UserRaised(exc, Phase.DATA) from None
