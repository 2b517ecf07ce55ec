"""`nandoctor.watch`: the probe's every-step detection inside the user's own training loop.

The user's loop keeps its own forward, backward and update; the doctor needs three seams:

- a forward pre-hook on the model: the first training-mode call after a step opens the next step
  (RNG state captured for the replay, the sampled stats hooks switched on), as `ProbeLoop` does
  before its forward;
- `check(loss, batch)` after backward: the watcher's one host sync and its fault decision, before
  the optimizer has stepped, so the parameters are exactly those that produced a fault. Where the
  steps can be replayed (`step_fn`, history.py), most steps are not read at all: their losses wait on
  the device, and a fault found at a later read is rolled back to the exact step it began at;
- the optimizer's `step`, wrapped on the instance: closes the step (the parameter check after the
  update, the timing) and, with `on_fault="skip_step"`, drops the update of a faulty step.

Detection is `StepWatcher`'s (the probe's own class), and the fault's findings come from the probe's
fault handling, so a loop and `nandoctor probe` on the same workload name the same first fault.
Everything is undone in `close()` (also on a context manager's exit by an exception).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from time import perf_counter
from typing import Any, Callable

from nandoctor.diagnosis.diagnose import StepTarget, note_replay_writes
from nandoctor.diagnosis.loss_trend import loss_warned
from nandoctor.engine.checker import disable_checker
from nandoctor.engine.sandbox import redirected
from nandoctor.engine.watcher import Fault, FaultKind, StepWatcher, current_lr
from nandoctor.findings import Mode, Report
from nandoctor.inloop.batch import FieldNamer
from nandoctor.inloop.forward import ForwardSeam
from nandoctor.inloop.history import StepHistory, batch_nbytes

log = logging.getLogger("nandoctor")

ON_FAULT = ("stop", "raise", "skip_step")


class ReplayError(RuntimeError):
    """A step_fn that cannot replay the failing step (nandoctor run without a loss to re-run)."""


class NonFiniteError(RuntimeError):
    """Raised by `check()` with `on_fault="raise"`; `.report` holds the full report."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


class Doctor:
    """Watches one model and optimizer; see `watch()` for the arguments."""

    def __init__(self, model: Any, optimizer: Any, *, step_fn: Callable[[Any, Any], Any] | None = None,
                 report_dir: str | Path | None = "nandoctor-report", on_fault: str = "stop", scaler: Any = None,
                 fields: list[str] | None = None, fp16: bool = False, sync: Any = None,
                 wrap_step: bool = True, defer_reads: bool = False, mode: Mode = Mode.WATCH,
                 target: StepTarget | None = None,
                 namer: Callable[[Any], tuple[dict[str, Any], Callable[[dict], Any]]] | None = None) -> None:
        import paddle

        if on_fault not in ON_FAULT:
            raise ValueError(f"on_fault={on_fault!r}: use one of {', '.join(ON_FAULT)}")
        if not isinstance(model, paddle.nn.Layer):
            raise TypeError(f"nandoctor.watch needs the paddle.nn.Layer you train, not a {type(model).__name__}")
        self.wrapper = model
        self.model = getattr(model, "_layers", model) if isinstance(model, paddle.DataParallel) else model
        self.optimizer = optimizer
        # Every call of step_fn is a replay's (the loop calls its own code itself): counted, so the report says
        # how many more times the user's code ran than their loop ran it (`details.replay_calls`)
        self.replay_calls = 0
        self._user_step_fn = step_fn
        self.step_fn = self._counted(step_fn) if step_fn is not None else None
        # What a call of step_fn runs of the user's code, in the report's words (`nandoctor run`: their model)
        self.replayed_code = _REPLAYED_CODE.get(mode, "your step_fn")
        # `nandoctor run`: a replay's failure in its users' terms (their model's call), else None
        self.replay_failure: Callable[[BaseException], str] | None = None
        self.report_dir = Path(report_dir) if report_dir is not None else None
        self.on_fault = on_fault
        self.names = fields
        # the batch given to check() -> (named fields, rebuild); `nandoctor run` gives its own (its batch is a
        # flat tuple of the model call's inputs and labels, named only when a read or a replay needs it)
        self._name_fields = namer if namer is not None else FieldNamer(fields)
        # the latest checked batch's rebuild: a fault read after its step (at close(), as the user's code
        # raised) has its batch and the sample bisection's subsets put back in the user's shape by it
        self._last_rebuild: Callable[[dict], Any] = lambda fields: None
        self.mode = mode
        # How the diagnosis names this workload's loss and data (a spec's, under --nproc); the replay is ours
        self.described = target
        # `nandoctor run`: a fault that began in loss code it cannot replay (runtime.py), else None
        self.loss_code_fault: Callable[[Fault], Any] | None = None
        # nandoctor run: (file, line, function) of the script's model call
        self.model_caller: Callable[[], tuple[str, int, str] | None] | None = None
        self.sync = sync  # nandoctor.parallel.distributed.RankSync under a multi-process launch, else None
        # A GradScaler Paddle left disabled (CPU: no float16 kernels) skips nothing: the probe has none there either
        if scaler is not None and not _enabled(scaler):
            scaler = None
        # The starting parameters, as the probe reads them: weights far from their fan-in's scale, and NaN/Inf
        # ones (a bad checkpoint), the cause a later fault is tied to (one host sync each, grouped)
        from nandoctor.diagnosis.causes import check_start

        self.causes = check_start(self.model, optimizer)
        self.watcher = StepWatcher(self.model, optimizer, scaler=scaler, fp16=fp16, amp=scaler is not None,
                                   start_nonfinite=self.causes.nonfinite)  # (none found: [], not found again)
        # Where a rollback can replay (history.py): most steps' losses left on the device, and a many-tensor
        # model's gradients read one step in four
        self.history: StepHistory | None = None
        if (defer_reads and step_fn is not None and optimizer is not None and on_fault != "skip_step"
                and sync is None and scaler is None):
            self.history = StepHistory(self.model, optimizer, self.watcher, self._name_fields)
        self.step = 0  # steps checked so far = the next step's index
        # Quiet steps (history.py): steps before `_quiet_until` are unread, without stats, and no snapshot is
        # due, so the seams only note them (`[step, batch_index, epoch, loss, lr, start, end, batch size]` and
        # the batch) and `_settle` does their bookkeeping when the window ends, or before anything reads it
        self._quiet_until = 0
        self._quiet: list[list[Any]] = []
        self._quiet_batches: list[Any] = []
        self._quiet_start: float | None = None  # a quiet step's forward ran at this time
        self._quiet_room = 0  # bytes of batches the quiet steps may still keep (history.room)
        self._tensor = paddle.Tensor
        self.fault: Fault | None = None
        self.report: Report | None = None
        self.skipped: list[int] = []
        self._open = False  # a step has begun (its forward ran) and is not yet closed
        self._checked = False  # ... and check() passed it: waiting for the update or the next forward
        self._skip_next = False
        # check() called before backward() (seen at the first check), and then the (loss, fields, rebuild,
        # step) of the check whose gradient half waits for optimizer.step()
        self._check_before_backward = False
        self._waiting: tuple | None = None
        self._loss_only = False  # a check's gradient half found no update to wait for (said once in the log)
        self._busy = False  # a replay is running: the pre-hook must not open steps
        # told True when the replays begin and False when they end (`nandoctor run`'s session: its seams ask
        # every step whether a replay is running, a flag instead of asking each watch's doctor)
        self.on_busy: Callable[[bool], None] | None = None
        self._closed = False
        self._inputs: Any = ()
        self._warned: set[Any] = set()
        self._hook = ForwardSeam(self.wrapper, self._pre_forward)  # (not a pre-hook: forward.py says why)
        self._orig_step = optimizer.step if optimizer is not None else None
        if optimizer is not None and wrap_step:  # (nandoctor run patches the class's step itself)
            optimizer.step = self._wrapped_step  # an instance attribute, deleted again in close()

    # ---- seams ----------------------------------------------------------------------------------
    def _pre_forward(self, layer: Any, inputs: Any) -> None:
        if self.step < self._quiet_until and not self._checked:
            if layer.training:
                self._inputs = inputs
                if self._quiet_start is None:
                    self._quiet_start = perf_counter()
            return
        if self._busy or self._closed or self.fault is not None and self.on_fault != "skip_step":
            return
        if not layer.training:
            return  # an evaluation pass between steps is not a training step
        self._settle()
        self._inputs = inputs  # a reference: what a crash in this step's code is asked about
        if self._waiting is not None:
            self._loss_only_step()
        if self._checked:  # accumulation: no optimizer step since the last check
            self._end_step(stepped=False)
            if self.history is not None:  # a replay steps once a batch: it could not stand in for the check
                self.history.off("gradient accumulation")
        if not self._open:
            self._begin()

    def _begin(self, rng: Any = None) -> None:
        if self.history is not None:
            self.history.begin(self.step)
        self.watcher.begin_step(self.step, {}, batch_index=self.step, rng=rng)
        self._open = True

    def open_step(self, rng: Any) -> None:
        """Open the current step after its forward already ran, with the RNG state from before that
        forward: `nandoctor run` finds the model only at the first update, after step 0's backward, and a
        replay of step 0 needs step 0's dropout masks."""
        if not self._open:
            self._begin(rng)

    def _end_step(self, stepped: bool) -> None:
        self.watcher.after_update(stepped=stepped)
        self._open = self._checked = False
        history = self.history
        if history is not None and self.fault is None and not self._check_before_backward:
            self._quiet_until = self.watcher.quiet_until(self.step)  # (none once the ring is given up)
            self._quiet_room = history.room()

    def _settle(self) -> None:
        """The quiet steps' bookkeeping, done together: the watcher's (as its stages would have done it), the
        ring's step times and the kept batches; a quiet step whose forward ran is begun. Before anything
        reads the watcher's state or a step needs its stages."""
        self._quiet_until = 0
        quiet = self._quiet
        if quiet:
            batches = self._quiet_batches
            self._quiet, self._quiet_batches = [], []
            # named now: the batches the watcher may keep (its first update's, its newest update's and the
            # open step's, `quiet_steps`); the others when a replay reads them (`StepHistory.keep_quiet`)
            named: list[tuple[dict[str, Any], Callable[[dict], Any]] | None] = [None] * len(batches)
            last = len(batches) - 1
            for i in {0, max(last - 1, 0), last}:
                named[i] = self._name_fields(batches[i])
            self._last_rebuild = named[-1][1]
            self.watcher.quiet_steps(quiet, [n[0] if n is not None else None for n in named])
            self.history.keep_quiet(quiet, batches, named)
            self._open = quiet[-1][6] is None  # checked, not yet updated: the optimizer's step ends it
        if self._quiet_start is not None:
            self._quiet_start = None
            self._begin()

    def _wrapped_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._waiting is not None and not self._closed and (self.fault is None or self.on_fault == "skip_step"):
            loss, fields, rebuild, step, _ = self._waiting  # check() ran before backward: its gradient half now
            self._waiting = None
            if not self._decide(self.watcher.after_backward(loss), fields, rebuild, step):
                if self.on_fault != "skip_step":
                    self.optimizer.clear_grad()
                    return None  # the faulty update is not applied
        if self._skip_next:  # on_fault="skip_step": this update would train on NaN/Inf gradients
            self._skip_next = False
            self.optimizer.clear_grad()
            return None
        out = self._orig_step(*args, **kwargs)
        if self._checked and not self._closed:
            self._stepped()
        return out

    def _stepped(self) -> None:
        """A checked step's update was applied: a quiet step's end is noted (its bookkeeping waits for the
        window's end), another step is closed (parameter check, timing)."""
        quiet = self._quiet
        if quiet and quiet[-1][6] is None:
            quiet[-1][6] = perf_counter()
            self._checked = False
            if self.step >= self._quiet_until:
                self._settle()
        else:
            self._end_step(stepped=True)

    # ---- the user's call ----------------------------------------------------------------------------
    def check(self, loss: Any, batch: Any = None) -> bool:
        """After `loss.backward()`, before `optimizer.step()`: True when the step may update.

        A step that is read (one host sync) returns True when its loss and gradients are finite. With
        `step_fn` and the batch given here (one update per batch, no scaler, no ranks, `on_fault` "stop" or
        "raise"), most steps after the first 64 are not read, as in the probe: the loss stays on the device
        until a later check reads it together with its own (or `close()` does), and True only says that no
        fault is known yet, so the update goes ahead. A non-finite value found at that later read is traced
        back: the steps since a snapshot are replayed through `step_fn`, and the report names the first
        faulty step (not the one whose check found it), its phase, layer, op and samples, as if caught
        live. The model and optimizer are then left as they were before that step's update (the updates
        after it are undone), and the check that found it answers as for any fault.

        On the first fault the report is built (the step replayed when `step_fn` was given) and written;
        then "stop" returns False (and every later call too), "raise" raises NonFiniteError, "skip_step"
        (every step read) returns False and makes the next `optimizer.step()` a no-op that clears the
        gradients, so training goes on without the faulty update.
        """
        step = self.step
        if step < self._quiet_until and self.watcher.usual_loss(loss):
            # a quiet step (see _settle): noted, its loss left on the device, detached (else it would keep its
            # step's autograd graph alive until the read); its batch sized by its fields' values, as FieldNamer
            # names them
            start, self._quiet_start = self._quiet_start, None
            size = batch_nbytes(batch if isinstance(batch, (tuple, list)) else batch.values()
                                if isinstance(batch, Mapping) else (batch,), self._tensor)
            self._quiet.append([step, step, 0, loss.detach(), current_lr(self.optimizer),
                                perf_counter() if start is None else start, None, size])
            self._quiet_batches.append(batch)
            self.step = step + 1
            self._checked = True
            self._quiet_room -= size
            if self._quiet_room < 0:  # the batches outgrew what may be kept: settled at this step's end
                self._quiet_until = 0
            return True
        if self._closed:
            raise RuntimeError("this nandoctor watch is closed; call nandoctor.watch again for a new run")
        if self.fault is not None and self.on_fault == "stop":
            return False
        self._settle()
        if self._waiting is not None:  # no update and no training-mode forward since the last check (evaluation)
            self._loss_only_step()
        if not self._open:  # the model was not called in training mode since the last step
            self._begin()
        fields, rebuild = self._name_fields(batch)
        self._last_rebuild = rebuild
        watcher = self.watcher
        watcher.attach_batch(fields, batch_index=step)
        fault = watcher.observe_loss(loss)
        # (only the first check can find the order out; written so that later ones make no call for it)
        if (fault is None and (self._check_before_backward or not step) and self._before_backward(loss)
                or fault is not None and _evaluating(fault, self.model)):
            return self._check_loss_first(loss, fields, rebuild, step)
        if fault is None:
            fault = watcher.after_backward(loss)
        return self._decide(fault, fields, rebuild, step)

    def _check_loss_first(self, loss: Any, fields: Any, rebuild: Any, step: int) -> bool:
        """A check with no gradient yet (before backward, or a loop that never calls it): the loss is judged
        now (one sync), so a NaN loss is this check's fault, answered False here; a finite one leaves the
        gradient half to `optimizer.step()`, before the update, or to nothing when no update comes."""
        value, fault = self.watcher.read_loss(loss)
        if fault is not None:
            self._skip_next = True  # the update the loop may still call after backward() would train on it
            return self._decide(fault, fields, rebuild, step)
        self._waiting = (loss, fields, rebuild, step, value)  # the gradients are checked at optimizer.step()
        self.step = step + 1
        return True

    def _loss_only_step(self) -> None:
        """The last check's gradient half never ran (no optimizer.step() came before this forward or the
        end): that step is over with its loss alone read, and no update."""
        value = self._waiting[4]
        self._waiting = None
        if not self._loss_only:
            self._loss_only = True
            log.info("nandoctor: a check() had no optimizer.step() after it before the next forward (a loop that "
                     "does not train, or gradient accumulation): its loss alone was checked")
        self.watcher.record_loss(value)
        self._end_step(stepped=False)

    def _before_backward(self, loss: Any) -> bool:
        """check() called between the forward and `loss.backward()` (no gradient exists yet, and the loss has
        a graph): not a loss that cannot train (`loss.no_grad`) but a loop in that order. Seen at the first
        check; from then on the gradient half of each check runs in the optimizer's step wrapper, before the
        update, where the gradients exist."""
        if self._check_before_backward:
            return True
        # watched without an optimizer, a loop may well never call backward (it monitors the loss); `nandoctor
        # run`'s checks without one follow a backward
        no_update = self._orig_step is None and self.mode == Mode.WATCH
        if self.step or not no_update and (self._orig_step is None
                                           or self._wrapped_step != vars(self.optimizer).get("step")):
            return False
        import paddle

        params = self.watcher.monitor.params
        if not (isinstance(loss, paddle.Tensor) and not loss.stop_gradient and params
                and all(p.grad is None for p in params)):
            return False
        if no_update:
            log.info("nandoctor: no gradient exists at check() and no optimizer was given: the loss alone is checked")
        else:
            log.warning("nandoctor: no gradient exists yet at check() (called before loss.backward(), or in a loop "
                        "that does not train): the loss is checked there, the gradients when optimizer.step() is "
                        "called (call check() after backward() to check both there)")
        self._check_before_backward = True
        return True

    def _decide(self, fault: Fault | None, fields: Any, rebuild: Any, step: int) -> bool:
        """The rest of a check once the fault (or None) is known: agreement across ranks, warnings, the
        report on the first fault and what `on_fault` asks for."""
        if self.sync is not None:
            fault = self.sync.agree(self, fault)
        self._warn()
        self.step = step + 1
        if fault is None:
            self._checked = True
            if self.history is not None:
                self.history.keep(step, fields, rebuild)
            return True
        self._end_step(stepped=False)
        self._quiet_until = 0
        if self.fault is not None:  # skip_step: a later fault is counted, not localised again
            self.skipped.append(step)
            self._skip_next = True
            return False
        self.fault = fault
        self._report(fault, rebuild)
        if self.on_fault == "raise":
            ff = self.report.first_fault if self.report else None
            raise NonFiniteError(f"nandoctor: non-finite values at step {self.fault.step}"
                                 + (f": {ff.as_location().describe()}" if ff else ""), self.report)
        if self.on_fault == "skip_step":
            self.skipped.append(step)
            self._skip_next = True
        return False

    def updated(self) -> None:
        """The update of a checked step was applied by a route other than `optimizer.step()` (hapi's
        `minimize`, `nandoctor run`'s own wrapper of the optimizer's class): close the step as the step
        wrapper would (parameter check, timing); a quiet step's bookkeeping waits for its window's end."""
        if self._checked and not self._closed and self._quiet and self._quiet[-1][6] is None:
            self._stepped()
            return
        self._settle()
        if self._checked and not self._closed:
            self._end_step(stepped=True)

    # ---- the end ------------------------------------------------------------------------------------
    def close(self) -> Report | None:
        """Remove the hooks and the optimizer wrapper; a run with warnings but no fault gets its report
        written now. Returns the report (None for a healthy run). Safe to call twice."""
        if self._closed:
            return self.report
        self._closed = True
        try:
            self._settle()
            if self._checked:
                self._end_step(stepped=False)
            elif self._waiting is not None and self.fault is None:
                self._loss_only_step()
            # the last update's check is one more sync; with ranks it would be a collective some skip
            fault = None if self.fault is not None or self.sync is not None else self.watcher.finish()
            if fault is not None:
                self.fault = fault
                self._report(fault, self._last_rebuild)
        finally:
            self._hook.remove()
            if self.optimizer is not None and vars(self.optimizer).get("step") == self._wrapped_step:
                del self.optimizer.step  # only our own wrapper: the class's step shows through again
            self.watcher.close()
        if self.report is None and (self.watcher.warnings(None) or loss_warned(self.watcher.records)):
            self._report(None, lambda f: None)
        if self.report is None:
            log.info("nandoctor: no non-finite value in %d step(s)", self.step)
        return self.report

    def crashed(self, exc: BaseException, fields: dict[str, Any] | None = None) -> Report | None:
        """The user's code raised in the loop (their loader, forward, loss, backward or update): the report
        names the step, the phase and the layer the exception came out of, as the probe's does, and is
        written; `fields` is the step's batch where known (`{}`: unknown). None once a fault was reported.
        Called while the user's exception propagates: a failure of ours is logged, never raised instead."""
        if self._closed or self.fault is not None or isinstance(exc, NonFiniteError):
            return None
        try:
            return self._crashed(exc, fields)
        except Exception as ours:  # noqa: BLE001 - never replace the user's exception with ours
            log.error("nandoctor: could not report the exception (%s: %s); please report this as a nandoctor bug",
                      type(ours).__name__, ours)
            return None

    def _crashed(self, exc: BaseException, fields: dict[str, Any] | None) -> Report | None:
        from nandoctor.diagnosis.crash import in_backward, in_data_loading, label_in_traceback
        from nandoctor.findings import Phase

        self._settle()
        unread = self.watcher.flush() if self.history is not None else None
        if unread is not None:  # a NaN on an earlier step left unread came first (and may be why the code raised)
            self.fault = unread
            self._report(unread, self._last_rebuild)
            return self.report
        if self._checked:
            phase = Phase.OPTIMIZER  # checked, not yet updated: the optimizer's step raised
        elif self._open:
            phase = Phase.BACKWARD if in_backward(exc) else Phase.FORWARD  # (no layer: crash.py says loss)
        elif in_data_loading(exc):
            phase = Phase.DATA  # no forward since the last step, and a loader raised: the batch was being made
        else:
            return None  # code between steps that is not the training's (a logging or checkpoint callback)
        if phase == Phase.DATA:
            fields = None  # the inputs the doctor holds are the last step's
        else:
            if not fields:  # the batch is given only to check(): the model's inputs of this step stand in
                fields = {f"input{i}": t for i, t in enumerate(self._inputs or ())}
            label = label_in_traceback(exc)
            if label is not None and "label" not in fields:
                fields = {**fields, "label": label}  # the label a functional loss raised on
        self.fault = Fault(FaultKind.CRASH, self.step, self.step, 0, fields, exc=exc, phase=phase)
        self._report(self.fault, lambda f: None)
        return self.report

    def summary(self) -> Report:
        """The report of this run, also when it is healthy (verdict `healthy`: timeline, per-layer details):
        what `nandoctor run --json` writes for a script that trained clean. Neither logged nor written, unless
        the steps still unread (read here, one sync) hold a fault: that is reported as at any read."""
        if self.report is not None:
            return self.report
        import paddle

        from nandoctor.diagnosis.assemble import new_report

        self._settle()
        unread = self.watcher.flush() if self.history is not None and not self._closed else None
        if unread is not None:  # (else the timeline would end at the last read, as if the rest never trained)
            self.fault = unread
            self._quiet_until = 0
            self._report(unread, self._last_rebuild)
            return self.report
        report = new_report(str(paddle.get_device()), self.mode)
        self.assemble_into(report, None, self._target(None))
        return report

    def __enter__(self) -> Doctor:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, Exception):  # the user's loop raised: their error is the finding (it still propagates)
            self.crashed(exc, {})
        self.close()

    def assemble_into(self, report: Report, fault: Fault | None, target: StepTarget) -> None:
        """The run so far as findings (diagnosis/assemble.py, the probe's own sequence)."""
        from nandoctor.diagnosis.assemble import RunFacts, assemble, target_label

        scaler = self.watcher.scaler
        init_scale = getattr(scaler, "_init_loss_scaling", None) if scaler is not None else None
        assemble(report, RunFacts(self.watcher, self.step, fault, target, self.optimizer, self.causes,
                                  lr=current_lr(self.optimizer), label=target_label(target, fault),
                                  init_loss_scale=float(init_scale) if init_scale is not None else None))

    # ---- helpers ------------------------------------------------------------------------------------
    def _report(self, fault: Fault | None, rebuild: Callable[[dict], Any]) -> None:
        """The fault's report: diagnosed (replayed, rolled back), agreed between ranks, logged and written."""
        alone = self.sync is not None and fault is not None and fault.kind == FaultKind.CRASH
        report = self._diagnosed(fault, rebuild)
        # A rank whose own code raised goes alone: the others are in a collective of the user's it never reaches
        if alone:
            report = self.sync.alone(self, report)
        elif self.sync is not None:
            report = self.sync.finish(self, report)
        self.report = report
        self._publish(report, write=not alone and (self.sync is None or self.sync.writes_report))
        if self.sync is not None and not alone:
            self.sync.barrier()  # no rank exits (and gets the launcher to kill the others) before rank 0 wrote

    def _diagnosed(self, fault: Fault | None, rebuild: Callable[[dict], Any]) -> Report:
        """The report of `fault` (None: the run so far), its replays run with the model's mode, the
        checker and the ranks' gradient sync as the user's loop had them, whatever happens."""
        import paddle

        from nandoctor.diagnosis.assemble import new_report

        self.watcher.monitor.begin_step(False)  # stats hooks off before any replay
        device = str(paddle.get_device())
        report = new_report(device, self.mode)
        peer = fault is not None and fault.evidence.get("peer")
        was_training = self.model.training
        self._set_busy(True)
        try:
            with _no_sync(self.wrapper):  # a replay on one rank must not wait for the others' gradients
                rolled, changed = None, []
                if self.history is not None and fault is not None:  # a fault that began on an unread step
                    with redirected(self._target(None).base_dir) as changed:  # its writes stay off the user's files
                        # the updates after the fault are undone: the steps run end where it stands
                        fault, rolled, self.step = self.history.rollback(fault, self.step_fn, rebuild, self.step)
                    self.fault = fault
                target = self._target(self._replay_loss(fault, rebuild))
                try:
                    self.assemble_into(report, None if peer else fault, target)
                except Exception as exc:  # noqa: BLE001 - inside the user's loop nothing of ours may raise
                    # the replay could not run (step_fn raised, or our replay failed): what the step's numbers say
                    why = (self.replay_failure(exc) if self.replay_failure is not None
                           else _replay_failure(exc, _REPLAY_RAISER.get(self.mode, "your step_fn")))
                    log.warning("nandoctor: the failing step could not be replayed: %s", why)
                    report = new_report(device, self.mode)
                    self.assemble_into(report, None if peer else fault,
                                       dataclasses.replace(target, replay_loss=None, replay_failed=why))
                    report.details["replay_failed"] = why
                if rolled is not None:
                    report.details["rollback"] = rolled
                if self.replay_calls:
                    report.details["replay_calls"] = {"count": self.replay_calls, "code": self.replayed_code}
                note_replay_writes(report, changed, "the rollback's replay of the unread steps")
        finally:
            self._set_busy(False)
            if not was_training:
                self.model.eval()
            disable_checker()
        return report

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy
        if self.on_busy is not None:
            self.on_busy(busy)

    def _publish(self, report: Report, *, write: bool) -> None:
        """The report logged (an error when it holds one), and written to report_dir when this rank writes."""
        from nandoctor.report.console import render_text
        from nandoctor.report.writer import write_folder

        text = render_text(report)
        (log.error if report.exit_code else log.warning)("nandoctor report\n%s", text)
        if self.report_dir is None or not write:
            return
        try:
            written = write_folder(report, self.report_dir)
            log.error("nandoctor: report written to %s", written)
        except OSError as exc:  # the loop trains on; the report stays in doctor.report
            log.error("nandoctor: could not write the report to %s (%s); it is in doctor.report, and the "
                      "report above is the same. Pass a writable report_dir= to nandoctor.watch.",
                      self.report_dir, exc.strerror or exc)

    def _target(self, replay_loss: Any) -> StepTarget:
        """What the diagnosis reads of this loop: the user's step_fn as the replay, their code's folder."""
        if self.described is not None:
            return dataclasses.replace(self.described, model=self.model, replay_loss=replay_loss,
                                       loss_code_fault=self.loss_code_fault, model_caller=self.model_caller)
        what = "step_fn" if self.step_fn is not None and self.mode != Mode.RUN else "your loss code"
        data = "your script's data loading" if self.mode == Mode.RUN else "the loop's batches"
        return StepTarget(model=self.model, replay_loss=replay_loss, base_dir=_base_dir(self._user_step_fn, self.model),
                          mode=self.mode, loss_source=what, data_source=data,
                          label_name=lambda fields: "label" if "label" in fields else None,
                          loss_code_fault=self.loss_code_fault, model_caller=self.model_caller)

    def _replay_loss(self, fault: Fault | None, rebuild: Callable[[dict], Any]) -> Any:
        """The replay's loss: the user's step_fn on the batch rebuilt in the user's shape (None: no replay)."""
        if self.step_fn is None or fault is None or fault.kind != FaultKind.NONFINITE:
            return None
        step_fn = self.step_fn
        rebuilds = self.history.rebuilds() if self.history is not None else {}

        def compute(model: Any, fields: dict[str, Any]) -> Any:
            return step_fn(model, rebuilds.get(id(fields), rebuild)(fields))

        return compute

    def _counted(self, step_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """`step_fn`, each call counted in `replay_calls` (a call that raises counts: the user's code ran)."""
        def counted(model: Any, batch: Any) -> Any:
            self.replay_calls += 1
            return step_fn(model, batch)

        return counted

    def _warn(self) -> None:
        """Warnings through `logging` as they appear (explosion, float16 headroom): host-side only."""
        tracker = self.watcher.tracker
        if tracker.explosion is not None and "explosion" not in self._warned:
            self._warned.add("explosion")
            log.warning("nandoctor: %s", tracker.explosion.message)
        for i in tracker.fp16_hits:
            if ("fp16", i) not in self._warned:
                self._warned.add(("fp16", i))
                step, top = tracker.fp16_hits[i]
                log.warning("nandoctor: layer %s outputs values up to %.3g at step %d, beyond float16's 65504",
                            tracker.layer_names[i], top, step)


def watch(model: Any, optimizer: Any = None, step_fn: Callable[[Any, Any], Any] | None = None, *,
          report_dir: str | Path | None = "nandoctor-report", on_fault: str = "stop", scaler: Any = None,
          fields: list[str] | None = None, fp16: bool = False, distributed: bool | None = None) -> Doctor:
    """Watch a training loop: `doctor.check(loss, batch)` after each backward (see Doctor.check).

    `step_fn(model, batch) -> loss` (the forward and loss of one step) lets the doctor replay a faulty
    step for its layer, op, parameter, source line and samples, and (given the batch at each check) leave
    most steps unread, a fault on one of them replayed from a snapshot (see Doctor.check for what True
    then means). `fields` names the parts of a tuple
    batch. In a process group the script set up itself (`init_parallel_env`, more than one process; or
    `distributed=True`), every rank must call `check` every step: the ranks agree on a fault with one
    collective per step. Processes that joined no group are each watched alone.
    """
    from nandoctor.parallel.distributed import RankSync, joined_ranks

    sync = None
    if distributed or (distributed is None and joined_ranks() > 1):
        sync = RankSync()
    return Doctor(model, optimizer, step_fn=step_fn, report_dir=report_dir, on_fault=on_fault, scaler=scaler,
                  fields=fields, fp16=fp16, sync=sync, defer_reads=True)


def _evaluating(fault: Fault, model: Any) -> bool:
    """A loss without a graph from a model in eval mode, or while gradients are off where check() runs: what
    an evaluation loop makes (`paddle.no_grad()` around it), not a loss that cannot train (`loss.no_grad`, kept
    for a model in training mode); its value alone is checked."""
    import paddle

    return (fault.kind == FaultKind.LOSS and fault.evidence.get("reason") == "stop_gradient"
            and (not model.training or not paddle.is_grad_enabled()))


# What one call of each way in's step_fn runs of the user's code (`details.replay_calls.code`)
_REPLAYED_CODE = {Mode.WATCH: "your step_fn", Mode.RUN: "your model", Mode.HAPI: "your network and loss",
                  Mode.TRAINER: "your model", Mode.PROBE: "your model and loss code"}


# Whose code raised when a replay failed in the user's code, in the words of each way in's users
_REPLAY_RAISER = {Mode.WATCH: "your step_fn", Mode.HAPI: "your network or loss", Mode.TRAINER: "your model",
                  Mode.PROBE: "your model or loss code"}


def _replay_failure(exc: BaseException, raiser: str = "your step_fn") -> str:
    """Why a replay failed, and whose it is: the user's code (`raiser`, their file and line) or nandoctor."""
    from nandoctor.workload.entrypoints import user_origin

    if isinstance(exc, ReplayError):
        return str(exc)
    origin = user_origin(exc, None)
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    if origin:
        return f"{raiser} raised {text} at {origin} when called again on the failing batch"
    return f"nandoctor's own replay failed ({text}); this is a nandoctor bug, please report it"


def _base_dir(fn: Any, model: Any) -> Path:
    """Where the user's code lives (source lines of a replayed op are shown relative to it): step_fn's
    folder, or the model class's when step_fn is nandoctor's own (the hapi callback's replay), unless that
    is an installed library's (a paddleformers model): everything under this folder counts as the user's
    code, so a library's folder would have its lines named as theirs. Else the working folder."""
    from nandoctor.workload.entrypoints import is_user_file

    own = Path(__file__).resolve().parent.parent
    for obj in (fn, type(model)):
        try:
            file = Path(inspect.getfile(obj)).resolve()
        except (TypeError, OSError):
            continue
        if not file.parent.is_relative_to(own) and is_user_file(file, None):
            return file.parent
    return Path.cwd()


def _enabled(scaler: Any) -> bool:
    try:
        return bool(scaler.is_enable())
    except Exception:  # noqa: BLE001 - a scaler-like object without is_enable: trust it
        return True


def _no_sync(wrapper: Any) -> Any:
    """DataParallel's `no_sync()` (replays stay on this rank), a no-op context for a plain model."""
    import contextlib

    import paddle

    if isinstance(wrapper, paddle.DataParallel):
        return wrapper.no_sync()
    return contextlib.nullcontext()

