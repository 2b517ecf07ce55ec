"""The probe's training loop: the user's calls in order, each behind the boundary that makes its
exception a finding; everything nandoctor does per step is the watcher's (watcher.py).

Only the user's own calls sit inside that boundary (`user_call`, batch_source.py): `iter()`/`next()` on the
loader (the loop draws its batches from a `BatchSource`, as the ranks and the replays do), the forward and
loss (`Workload.compute_loss`), `backward`, `optimizer.step`/`clear_grad` and the scheduler's step. An
exception anywhere else is nandoctor's own and propagates (the CLI reports it as an internal error), so a
bug of ours is never blamed on the user's optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

from nandoctor.engine.batch_source import BatchSource, UserRaised, user_call
from nandoctor.engine.interrupt import reassert
from nandoctor.engine.snapshots import MIN_EVERY
from nandoctor.engine.step import StepEngine
from nandoctor.engine.watcher import Fault, FaultKind, StatsSchedule, StepRecord, StepWatcher, current_lr
from nandoctor.findings import Phase

if TYPE_CHECKING:  # (annotations only: a watched process does not load the spec's parser)
    from nandoctor.workload.build import Workload

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
        batches = self._batches()
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
        can_quiet = self._defer_reads()

        def settle() -> None:
            if quiet:
                watch.quiet_steps(quiet, quiet_fields)
                quiet.clear()
                quiet_fields.clear()

        try:
            for step, epoch, batch_index, batch in batches:
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
                        fields = None  # (an exception drawing the next batch is not this batch's)
                        res.steps_run = step + 1 - start
                        if step + 1 >= quiet_until:
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
                if can_quiet:
                    quiet_until = watch.quiet_until(step + 1)
                fields = None
                res.steps_run = step + 1 - start
                progress(res.steps_run, total, "probe step")
            settle()
            if res.fault is None:
                res.fault = watch.finish()
        except UserRaised as raised:
            settle()
            batches.close()  # closed, it says where it stopped: the step being trained, or whose batch was drawn
            res.fault = self._crash(raised, batches, fields, in_quiet)
        except KeyboardInterrupt:
            settle()
            res.interrupted = True
            # the unread steps' records for the partial report; a fault among them is not replayed after Ctrl-C
            watch.flush()
        finally:
            watch.monitor.begin_step(False)  # detach the stats hooks before any replay
            batches.close()  # the loader's workers end now
            self.release_batches()  # the fault holds its own batch: the replays after the loop read theirs
        res.epochs = batches.epochs
        res.records = watch.records
        res.stats_every = watch.stats_every
        return res

    def _batches(self) -> BatchSource:
        """The loop's batches: the loader from its start, or past the batches trained before the checkpoint
        (workload.resume_at). The ring keeps the RNG each epoch's loader is made with (its shuffle); the
        data entry's imports may reset SIGTERM in C (`reassert`, once an epoch)."""
        w, start = self.w, self.start_step
        resume = (lambda: w.resume_at(start, self._on_epoch)) if start else None
        return BatchSource(start + self.steps, start=start, make_loader=w.make_loader, resume=resume,
                           before_epoch=self._on_epoch, opened=reassert, end_epoch=self.engine.end_epoch)

    def _defer_reads(self) -> bool:
        """With a snapshot ring, what the watcher may leave unread; whether the loop may run quiet steps."""
        ring = self.snapshots
        if ring is None or ring.disabled is not None:
            return False
        # a fault on a step whose gradients (or whole read) went unread can be replayed from the ring
        # (rollback.py), as long as no more steps go unread in a row than the ring's interval
        self.watcher.defer_grads(DEFER_EVERY)
        self.watcher.defer_reads(ring)
        if ring.batches is not None:  # an update fault's batch is read back from the tape (read_batch)
            self.watcher.keep_update_batches = False
        return self.engine.accumulate == 1

    def _crash(self, raised: UserRaised, batches: BatchSource, fields: dict[str, Any] | None,
               in_quiet: bool) -> Fault:
        """The fault of the user's exception, where the (closed) batches stopped: at the step the loop was
        training, or drawing the batch of."""
        watch = self.watcher
        step, batch_index, epoch = batches.step, batches.batch_index, batches.epoch
        if in_quiet:  # raised in a quiet step: the watcher begins it, as it would have before its forward
            watch.begin_step(step, fields or {}, batch_index=batch_index, epoch=epoch)
        # a NaN in the batch that made the model's code raise is the data's fault, named as such; a
        # non-finite loss on an earlier, unread step came first
        bad_data = watch.data_fault(raised.exc) if fields is not None and raised.phase in _STEP_PHASES else None
        return watch.flush() or bad_data or Fault(FaultKind.CRASH, step, batch_index, epoch,
                                                  fields if raised.phase != Phase.DATA else None, exc=raised.exc,
                                                  phase=raised.phase)

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


_STEP_PHASES = (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD)
