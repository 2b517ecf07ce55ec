"""Inside the user's unmodified script (`nandoctor run`): find the model, the loss, the batch and the
optimizer through Paddle's own seams, and drive a `Doctor` with them.

Loaded by the sitecustomize that `nandoctor run` puts first on PYTHONPATH; it patches Paddle only once
Paddle is imported, and only when NANDOCTOR_RUN is set (so the variable leaking into other programs
does nothing). The seams:

- `paddle.nn.Layer.__call__`: the outermost calls in training mode, each with its positional and
  keyword inputs, the RNG state before it, and the gradient that comes back to its outputs; the one
  whose parameters the optimizer trains is the model, and a layer called on the model's output is the
  loss (its other inputs are the label). Once both are known, the class patch is removed and forward
  hooks on those two layers take over, so the other layers keep Paddle's fast call path.
- `Tensor.backward`: the tensor backpropagated last is the loss.
- `Optimizer.step` (and `minimize`, which `paddle.Model.fit` uses): the check, between backward and the
  update; a faulty update is never applied.

Replays need the step's loss as a function of the batch. With a loss layer that is `loss(model(...),
label)`; with a model that returns its own loss (an output object's `.loss`), that loss; with a loss
written as functions, the gradient that came back to each of the model's output tensors is recorded
(one tensor hook each) and the replay backpropagates those same gradients through the model, which
reproduces every fault inside the model. A fault that began in loss code written as functions (the
model's outputs finite, the loss or the gradient coming back to them not) cannot be replayed: it is
named as such, with the samples whose rows of that gradient are non-finite (`loss_code_fault`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from nandoctor.zero_change.capture import ROW, batch_rows, input_names, keep_grads, leaves

ENV = "NANDOCTOR_RUN"
_MAX_ROOTS = 8


class _Call:
    """One outermost training-mode layer call before the model is known: enough to replay it."""

    def __init__(self, layer: Any, args: tuple, kwargs: dict, rng: Any) -> None:
        self.layer, self.args, self.kwargs, self.rng = layer, args, kwargs, rng
        self.output: Any = None
        self.grads: dict[int, Any] = {}


class Session:
    """The state of one watched process."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.depth = 0
        self.roots: list[_Call] = []  # outermost training-mode calls since the last step (before attaching)
        self.model: Any = None
        self.loss_layer: Any = None
        self.optimizer: Any = None
        self.doctor: Any = None
        self.last_loss: Any = None
        self.inputs: tuple = ()
        self.kwargs: dict = {}
        self.output: Any = None
        self.labels: tuple = ()
        self.grads: dict[int, Any] = {}  # output leaf index -> the gradient that came back to it
        self.names: list[str] = []
        self.done = False
        self.orig: dict[str, Any] = {}
        self.started = time.monotonic()
        # The checked pass (recheck.py): this process re-runs the command to name a loss-code op
        self.recheck: Any = None
        if config.get("recheck_step") is not None:  # (imported only there: every watched process starts here)
            from nandoctor.zero_change.recheck import CheckedPass

            self.recheck = CheckedPass(config)

    @property
    def busy(self) -> bool:
        return self.doctor is not None and self.doctor._busy

    # ---- seams ----------------------------------------------------------------------------------------
    def layer_call(self, layer: Any, args: tuple, kwargs: dict) -> Any:
        call = self.orig["call"]
        if self.depth or self.busy:
            return call(layer, *args, **kwargs)
        training = layer.training
        # The RNG state before the call (a replay of step 0 needs its dropout masks): until the model is known
        root = _Call(layer, args, kwargs, sys.modules["paddle"].get_rng_state()) if training else None
        self.depth += 1
        try:
            out = call(layer, *args, **kwargs)
        finally:
            self.depth -= 1
        if root is None:
            return out
        if self.recheck is not None and self.recheck.is_model(layer):
            self.recheck.after_model(0)  # step 0: the model is not known yet, but its class is
        root.output = out
        keep_grads(out, root.grads)
        self.roots.append(root)
        del self.roots[:-_MAX_ROOTS]
        return out

    def run_backward(self, run: Any) -> Any:
        """`loss.backward()` itself: under the checked pass's watch at its step."""
        return run() if self.recheck is None else self.recheck.backward(run)

    def backward(self, tensor: Any) -> None:
        if not self.busy:
            self.last_loss = tensor

    def before_step(self, optimizer: Any) -> bool:
        """True when the update may go ahead."""
        if self.busy or self.last_loss is None or self.done and not self.config.get("keep_going"):
            return True
        if self.doctor is None and not self._attach(optimizer):
            return True
        if optimizer is not self.optimizer:
            return True
        if self.recheck is not None and self.recheck.armed:
            self.recheck.not_reproduced(f"the checked pass saw no NaN/Inf op after the model's forward at step "
                                        f"{self.recheck.step} (the script may not run the same twice)")
        fields = self._fields()
        ok = self.doctor.check(self.last_loss, fields)
        self.last_loss = None
        if ok:
            return True
        if not self.done:  # the first fault; later ones (--keep-going) are counted and their updates dropped
            self._finish()
        return False

    def after_step(self, optimizer: Any) -> None:
        if self.doctor is not None and optimizer is self.optimizer:
            self.doctor.updated()

    # ---- finding the model and the loss ------------------------------------------------------------------
    def _attach(self, optimizer: Any) -> bool:
        """The first update: the model is the outermost layer whose parameters the optimizer trains."""
        from nandoctor.probe.nan_params import optimizer_params

        trained = {id(p) for p in optimizer_params(optimizer)}
        best = self._model_call(lambda layer: sum(1 for p in layer.parameters() if id(p) in trained))
        if best is None:
            return False
        report_dir = self.config.get("report_dir")
        sync = _sync()
        if sync is not None and report_dir is None:  # ranks merge through files: a folder beside the result
            report_dir = str(Path(self.config["result"]).with_name("ranks"))
        self._watch(best, optimizer, report_dir, sync)
        self._switch_to_hooks()
        mark(self.config, "watched")
        return True

    def _attach_without_update(self) -> bool:
        """The script dies before its first update: the model is the outermost layer with most parameters
        (no collective: the other ranks are not checking with this one)."""
        best = self._model_call(lambda layer: len(list(layer.parameters())))
        if best is None:
            return False
        self._watch(best, None, self.config.get("report_dir"), None)
        return True

    def _model_call(self, score: Any) -> _Call | None:
        """The outermost call since the last step whose layer scores highest (above 0), and the loss layer
        called on its output."""
        best, best_n = None, 0
        for root in self.roots:
            n = score(root.layer)
            if n > best_n:
                best, best_n = root, n
        if best is not None:
            for root in self.roots:
                if root.layer is not best.layer and root.args and root.args[0] is best.output:
                    self.loss_layer, self.labels = root.layer, tuple(root.args[1:])
        return best

    def _watch(self, best: _Call, optimizer: Any, report_dir: str | None, sync: Any) -> None:
        """The Doctor on the model found, with step 0 (which ran before it was known) open from its RNG."""
        from nandoctor.findings import Mode
        from nandoctor.inloop.doctor import Doctor

        self.model, self.optimizer = best.layer, optimizer
        self._record(best.args, best.kwargs)
        self.output, self.grads = best.output, best.grads
        self.roots = []
        self.doctor = Doctor(self.model, optimizer, step_fn=self._replay, report_dir=report_dir,
                             on_fault=self._on_fault(), wrap_step=False, sync=sync, mode=Mode.RUN)
        self.doctor.loss_code_fault = self._loss_code_fault
        self.doctor.open_step(best.rng)

    def _record(self, args: tuple, kwargs: dict) -> None:
        """A model call's inputs: positional ones named after forward's parameters, keyword ones by keyword."""
        self.inputs = tuple(args)
        self.kwargs = dict(kwargs or {})
        if len(self.names) != len(self.inputs):
            self.names = input_names(self.model, len(self.inputs), self.kwargs)

    def _switch_to_hooks(self) -> None:
        """The model and the loss are known: record their calls with hooks, give Layer its own __call__ back."""
        paddle_layer = sys.modules["paddle"].nn.Layer
        paddle_layer.__call__ = self.orig["call"]

        def on_model(_layer: Any, args: Any, kwargs: Any) -> None:
            if not self.busy and self.model.training:
                self._record(args, kwargs)

        def on_model_out(_layer: Any, _args: Any, out: Any) -> None:
            if self.busy or not self.model.training:
                return
            if self.recheck is not None:
                self.recheck.after_model(self.doctor.step if self.doctor is not None else 0)
            self.output = out
            self.grads = {}
            if self.loss_layer is None:
                keep_grads(out, self.grads)

        def on_loss(_layer: Any, args: Any) -> None:
            if not self.busy:
                self.labels = tuple(args[1:])

        self.model.register_forward_pre_hook(on_model, with_kwargs=True)
        self.model.register_forward_post_hook(on_model_out)
        if self.loss_layer is not None:
            self.loss_layer.register_forward_pre_hook(on_loss)

    def _fields(self) -> dict[str, Any]:
        import paddle

        fields = dict(zip(self.names, self.inputs))
        fields.update({k: v for k, v in self.kwargs.items() if isinstance(v, paddle.Tensor)})
        for i, label in enumerate(self.labels):
            fields["label" if len(self.labels) == 1 else f"label{i}"] = label
        n = batch_rows(fields.values())
        if n is not None:
            fields[ROW] = paddle.arange(n, dtype="int64")
        return fields

    def _own_loss(self, outs: list[Any]) -> int | None:
        """The position of the backpropagated loss among the model's outputs (a model that returns its loss)."""
        loss = self.last_loss
        return next((i for i, t in enumerate(outs) if t is loss), None)

    def _replay(self, model: Any, fields: dict[str, Any]) -> Any:
        """The step's loss from (part of) its batch: the loss layer's, the model's own, or the recorded
        output gradients backpropagated through the model again."""
        import paddle

        from nandoctor.inloop.doctor import ReplayError

        inputs = [fields[n] for n in self.names]
        kwargs = {k: fields.get(k, v) for k, v in self.kwargs.items()}
        out = model(*inputs, **kwargs)
        if self.loss_layer is not None:
            labels = [fields[k] for k in fields if k.startswith("label") and k not in kwargs]
            return self.loss_layer(out, *labels)
        outs = leaves(out)
        own = self._own_loss(leaves(self.output))
        if own is not None and own < len(outs):
            return outs[own]
        rows = fields.get(ROW)
        total = None
        for i, grad in self.grads.items():
            if i >= len(outs):
                continue
            if rows is not None and int(rows.shape[0]) != int(grad.shape[0]):
                grad = paddle.gather(grad, rows)
            # NaN/Inf rows came from loss code that is not replayed (`_loss_code_fault` named them): the
            # model's own faults show with finite gradients
            grad = paddle.where(paddle.isfinite(grad), grad, paddle.zeros_like(grad))
            term = (outs[i] * grad).sum()
            total = term if total is None else total + term
        if total is None:
            raise ReplayError("no loss to replay: the loss is not a paddle.nn.Layer and no gradient came back to a "
                              "tensor output of the model")
        return total

    def _loss_code_fault(self, fault: Any) -> Any:
        """A fault that began in loss code written as functions: the model's outputs finite, and the loss
        or the gradient that came back to them not. None when the replay can reach the fault."""
        import math

        import numpy as np

        from nandoctor.batches import to_numpy
        from nandoctor.findings import Phase
        from nandoctor.probe.diagnose import LossCodeFault

        outs = leaves(self.output)
        if self.loss_layer is not None or not outs or self._own_loss(outs) is not None:
            return None
        if not all(np.isfinite(to_numpy(t)).all() for t in outs):
            return None  # the model's forward went non-finite: the replay names where
        loss_ok = fault.stats is not None and math.isfinite(fault.stats.loss)
        n = batch_rows(outs)
        rows: set[int] = set()
        bad_grad = False
        for grad in self.grads.values():
            arr = to_numpy(grad)
            bad = ~np.isfinite(arr)
            if not bad.any():
                continue
            bad_grad = True
            if n is not None and arr.ndim > 0 and arr.shape[0] == n:
                rows.update(np.nonzero(bad.reshape(n, -1).any(axis=1))[0].tolist())
        if loss_ok and not bad_grad:
            return None  # finite loss, finite gradient at the outputs: the fault is in the model's backward
        found = LossCodeFault(phase=Phase.BACKWARD if loss_ok else Phase.LOSS, rows=sorted(rows) or None,
                              batch_size=n)
        if self.recheck is None and self.doctor.sync is None:  # ranks: a re-run of every rank is not ours to start
            from nandoctor.zero_change.recheck import run_checked_pass

            answer = run_checked_pass(self.config, fault.step, self.model, self.started)
            if answer.get("op"):
                found.op, found.source = answer["op"], answer.get("source")
                if answer.get("phase") == "loss":  # a harmful Inf in the loss code's forward came first
                    found.phase = Phase.LOSS
                found.notes.append(f"op and line from a checked second pass of the command up to step {fault.step}, "
                                   f"with Paddle's tensor checker on after the model's forward ({answer['seconds']} s)")
            else:
                found.notes.append(f"no op named: {answer.get('error')}")
            if answer.get("changed_files"):
                shown = ", ".join(answer["changed_files"][:10])
                found.notes.append(f"the checked pass changed {len(answer['changed_files'])} file(s) in the working "
                                   f"folder by a route nandoctor does not redirect (C code): {shown}")
        return found

    def crashed(self, exc: BaseException) -> None:
        """The script dies of an exception of its own: a `user_code.error` report (step, phase, layer), also
        when it dies before its first update (the model is then the outermost layer with most parameters)."""
        if self.done or self.recheck is not None or not isinstance(exc, Exception):
            return
        if self.doctor is None and not self._attach_without_update():
            return
        report = self.doctor.crashed(exc, self._fields() if self.doctor._open else None)
        if report is not None:
            self.done = True
            write_result(self.config, report)

    # ---- the end -------------------------------------------------------------------------------------
    def _on_fault(self) -> str:
        """--keep-going: every later faulty update is dropped too (the doctor's skip_step), else stop."""
        return "skip_step" if self.config.get("keep_going") else "stop"

    def _finish(self) -> None:
        """A fault: outputs written; the script stopped unless --keep-going."""
        if self.recheck is not None:
            self.recheck.not_reproduced(f"the checked pass found a fault at step {self.doctor.fault.step}, before "
                                        f"step {self.recheck.step}: the script does not run the same twice")
        self.done = True
        write_result(self.config, self.doctor.report)
        if self.doctor.sync is not None:
            self.doctor.sync.barrier()  # rank 0's result is on disk before any rank exits
        if not self.config.get("keep_going"):
            self.doctor.close()
            sys.stdout.flush()
            raise SystemExit(1)


def write_result(config: dict[str, Any], report: Any) -> None:
    """The report as JSON where the parent `nandoctor run` reads it (one file per rank)."""
    from nandoctor.report import json as json_report

    path = Path(config["result"])
    rank = os.environ.get("PADDLE_TRAINER_ID")
    if rank not in (None, "", "0"):
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    if report is not None:
        path.write_text(json_report.render(report), encoding="utf-8")


def mark(config: dict[str, Any], what: str) -> None:
    """Tell the parent how far the watch got (`watched`: a model and optimizer were found), by a file."""
    try:
        Path(config["result"]).with_name(what).touch()
    except OSError:
        pass


def _sync() -> Any:
    from nandoctor.distributed import RankSync, joined_ranks

    return RankSync() if joined_ranks() > 1 else None


SESSION: Session | None = None


def install() -> None:
    """From sitecustomize: a session when NANDOCTOR_RUN is set; the patches once Paddle is imported."""
    global SESSION
    raw = os.environ.get(ENV)
    if not raw or SESSION is not None:
        return
    try:
        config = json.loads(raw)
    except ValueError:
        return
    if config.get("recheck_step") is not None:  # the checked pass: the user's files stay as the real run left them
        from nandoctor.sandbox import redirect_writes

        redirect_writes(Path(config["mirror"]), exempt=Path(config["result"]).parent)
    SESSION = Session(config)
    _quiet_logger()
    import atexit

    atexit.register(_at_exit)
    if config.get("recheck_step") is None:
        previous = sys.excepthook

        def excepthook(kind: type, exc: BaseException, tb: Any) -> None:
            try:
                SESSION.crashed(exc)
            except Exception:  # noqa: BLE001 - never stand between the user and their traceback
                pass
            previous(kind, exc, tb)

        sys.excepthook = excepthook
    from nandoctor.zero_change.seams import AfterImport

    session = SESSION
    if "paddle" in sys.modules and hasattr(sys.modules["paddle"], "optimizer"):
        _on_paddle(session)
        return
    sys.meta_path.insert(0, AfterImport("paddle", lambda: _on_paddle(session)))


def _on_paddle(session: Session) -> None:
    """Paddle was imported: the seams, and the RNG states a checked pass needs (saved, or restored in it)."""
    from nandoctor.zero_change import recheck
    from nandoctor.zero_change.seams import patch_paddle

    patch_paddle(session)
    if session.recheck is not None:
        recheck.restore_rng(session.config["rng"])
    else:
        recheck.save_rng(session.config)
        _report_on_sigterm()


def _report_on_sigterm() -> None:
    """SIGTERM (`nandoctor run` passing on a timeout or a cancel) ends a script that has no handler of its
    own at once, without atexit: write the partial report first, then die of the signal as it would have.
    Set after `import paddle`, whose own C handler it replaces; a handler the script sets later wins."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum: int, _frame: Any) -> None:
        try:
            _at_exit()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _at_exit() -> None:
    """The script ended on its own (--keep-going, or nothing found): close the watch, keep its report (a
    healthy one too: `--json` is written for every run)."""
    session = SESSION
    if session is not None and session.recheck is not None:
        session.recheck.not_reproduced(f"the script ended before step {session.recheck.step}")
    if session is None or session.doctor is None:
        return
    try:
        session.doctor.close()
        if not session.done:
            write_result(session.config, session.doctor.summary())
        elif session.doctor.report is not None and session.doctor.skipped:  # --keep-going: what was dropped
            session.doctor.report.details["skipped_steps"] = list(session.doctor.skipped)
            write_result(session.config, session.doctor.report)
    except Exception:  # noqa: BLE001 - never turn the user's exit into a traceback of ours
        pass


def _quiet_logger() -> None:
    """The parent prints the report; the child's `nandoctor` logger stays silent."""
    import logging

    logger = logging.getLogger("nandoctor")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
