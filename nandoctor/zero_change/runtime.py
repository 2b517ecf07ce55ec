"""Inside the user's unmodified script (`nandoctor run`): find the model, the loss, the batch and the
optimizer through Paddle's own seams, and drive a `Doctor` with them.

Loaded by the sitecustomize that `nandoctor run` puts first on PYTHONPATH; it patches Paddle only once
Paddle is imported, and only when NANDOCTOR_RUN is set (so the variable leaking into other programs
does nothing). The seams:

- `paddle.nn.Layer.__call__`: the outermost calls in training mode; the one whose parameters the
  optimizer trains is the model (its positional inputs, named after its forward's parameters, are the
  batch), and a layer called on the model's output is the loss (its other inputs are the label). Once
  both are known, the class patch is removed and forward pre-hooks on those two layers take over, so
  the other layers keep Paddle's fast call path.
- `Tensor.backward`: the tensor backpropagated last is the loss.
- `Optimizer.step` (and `minimize`, which `paddle.Model.fit` uses): the check, between backward and the
  update; a faulty update is never applied.

Replays need the step's loss as a function of the batch. With a loss layer that is `loss(model(x),
label)`; with a loss written as functions, the gradient that reached the model's output is recorded
(one tensor hook) and the replay backpropagates that same gradient through the model, which reproduces
every fault inside the model. A non-finite loss computed by functions outside any layer is reported
from the step's numbers (phase loss, no op).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

ENV = "NANDOCTOR_RUN"
ROW = "nandoctor_row"  # a field of sample positions, so a replay of a subset takes the same rows


class Session:
    """The state of one watched process."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.depth = 0
        self.roots: list[tuple[Any, tuple, dict, Any]] = []  # outermost training-mode calls since the last step
        self.model: Any = None
        self.loss_layer: Any = None
        self.optimizer: Any = None
        self.doctor: Any = None
        self.last_loss: Any = None
        self.inputs: tuple = ()
        self.kwargs: dict = {}
        self.output: Any = None
        self.labels: tuple = ()
        self.grad_out: Any = None
        self.names: list[str] = []
        self.done = False
        self.orig: dict[str, Any] = {}

    @property
    def busy(self) -> bool:
        return self.doctor is not None and self.doctor._busy

    # ---- seams ----------------------------------------------------------------------------------------
    def layer_call(self, layer: Any, args: tuple, kwargs: dict) -> Any:
        call = self.orig["call"]
        if self.depth or self.busy:
            return call(layer, *args, **kwargs)
        self.depth += 1
        try:
            out = call(layer, *args, **kwargs)
        finally:
            self.depth -= 1
        if layer.training:
            self.roots.append((layer, args, kwargs, out))
            del self.roots[:-8]
        return out

    def backward(self, tensor: Any) -> None:
        if not self.busy:
            self.last_loss = tensor

    def before_step(self, optimizer: Any) -> bool:
        """True when the update may go ahead."""
        if self.done or self.busy or self.last_loss is None:
            return True
        if self.doctor is None and not self._attach(optimizer):
            return True
        if optimizer is not self.optimizer:
            return True
        fields = self._fields()
        ok = self.doctor.check(self.last_loss, fields)
        self.last_loss = None
        if ok:
            return True
        self._finish()
        return False

    def after_step(self, optimizer: Any) -> None:
        if self.doctor is not None and optimizer is self.optimizer:
            self.doctor.updated()

    # ---- finding the model and the loss ------------------------------------------------------------------
    def _attach(self, optimizer: Any) -> bool:
        from nandoctor.inloop.doctor import Doctor

        trained = {id(p) for p in _opt_params(optimizer)}
        best, best_n = None, 0
        for layer, args, kwargs, out in self.roots:
            n = sum(1 for p in layer.parameters() if id(p) in trained)
            if n > best_n:
                best, best_n = (layer, args, kwargs, out), n
        if best is None:
            return False
        self.model, self.inputs, self.kwargs, self.output = best
        self.optimizer = optimizer
        for layer, args, _, _ in self.roots:
            if layer is not self.model and args and args[0] is self.output:
                self.loss_layer, self.labels = layer, tuple(args[1:])
        self.names = _input_names(self.model, len(self.inputs))
        self._switch_to_hooks()
        mark(self.config, "watched")
        report_dir = self.config.get("report_dir")
        sync = _sync()
        if sync is not None and report_dir is None:  # ranks merge through files: a folder beside the result
            report_dir = str(Path(self.config["result"]).with_name("ranks"))
        self.doctor = Doctor(self.model, optimizer, step_fn=self._replay, report_dir=report_dir,
                             on_fault="stop", wrap_step=False, sync=sync)
        return True

    def _switch_to_hooks(self) -> None:
        """The model and the loss are known: record their calls with hooks, give Layer its own __call__ back."""
        import paddle

        paddle.nn.Layer.__call__ = self.orig["call"]

        def on_model(_layer: Any, args: Any, kwargs: Any = None) -> None:
            if not self.busy and self.model.training:
                self.inputs = tuple(args)

        def on_model_out(_layer: Any, _args: Any, out: Any) -> None:
            if self.busy or not self.model.training:
                return
            self.output = out
            if self.loss_layer is None and isinstance(out, paddle.Tensor) and not out.stop_gradient:
                out.register_hook(self._keep_grad)

        def on_loss(_layer: Any, args: Any) -> None:
            if not self.busy:
                self.labels = tuple(args[1:])

        self.model.register_forward_pre_hook(on_model)
        self.model.register_forward_post_hook(on_model_out)
        if self.loss_layer is not None:
            self.loss_layer.register_forward_pre_hook(on_loss)

    def _keep_grad(self, grad: Any) -> None:
        self.grad_out = grad.detach()

    def _fields(self) -> dict[str, Any]:
        import paddle

        fields = dict(zip(self.names, self.inputs))
        for i, label in enumerate(self.labels):
            fields["label" if len(self.labels) == 1 else f"label{i}"] = label
        n = _rows(self.inputs)
        if n is not None:
            fields[ROW] = paddle.arange(n, dtype="int64")
        return fields

    def _replay(self, model: Any, fields: dict[str, Any]) -> Any:
        """The step's loss from (part of) its batch: the loss layer's, or the recorded output gradient's."""
        import paddle

        from nandoctor.inloop.doctor import ReplayError

        inputs = [fields[n] for n in self.names]
        out = model(*inputs, **self.kwargs)
        if self.loss_layer is not None:
            labels = [fields[k] for k in fields if k.startswith("label")]
            return self.loss_layer(out, *labels)
        grad = self.grad_out
        if grad is None or not isinstance(out, paddle.Tensor):
            raise ReplayError("no loss to replay: the loss is not a paddle.nn.Layer and no output gradient was seen")
        rows = fields.get(ROW)
        if rows is not None and int(rows.shape[0]) != int(grad.shape[0]):
            grad = paddle.gather(grad, rows)
        grad = paddle.where(paddle.isfinite(grad), grad, paddle.zeros_like(grad))
        return (out * grad).sum()

    # ---- the end -------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """A fault: outputs written; the script stopped unless --keep-going."""
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
    from nandoctor.distributed import RankSync, world_size

    return RankSync() if world_size() > 1 else None


def _opt_params(optimizer: Any) -> list[Any]:
    params = getattr(optimizer, "_parameter_list", None) or []
    out = []
    for p in params:
        if isinstance(p, dict):  # parameter groups
            out += list(p.get("params", []))
        else:
            out.append(p)
    return out


def _input_names(model: Any, n: int) -> list[str]:
    """The model's forward parameter names for its positional inputs (`a`, `b`), else x0, x1, ..."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if len(params) >= n and not any(p.startswith("label") or p == ROW for p in params[:n]):
        return params[:n]
    return [f"x{i}" for i in range(n)]


def _rows(inputs: tuple) -> int | None:
    sizes = {int(x.shape[0]) for x in inputs if hasattr(x, "shape") and len(x.shape) > 0}
    return sizes.pop() if len(sizes) == 1 else None


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
    SESSION = Session(config)
    _quiet_logger()
    import atexit

    atexit.register(_at_exit)
    from nandoctor.zero_change.seams import AfterImport, patch_paddle

    session = SESSION
    if "paddle" in sys.modules and hasattr(sys.modules["paddle"], "optimizer"):
        patch_paddle(session)
        return
    sys.meta_path.insert(0, AfterImport("paddle", lambda: patch_paddle(session)))


def _at_exit() -> None:
    """The script ended on its own (--keep-going, or nothing found): close the watch, keep its report."""
    session = SESSION
    if session is None or session.doctor is None:
        return
    try:
        report = session.doctor.close()
        if report is not None and not session.done:
            write_result(session.config, report)
    except Exception:  # noqa: BLE001 - never turn the user's exit into a traceback of ours
        pass


def _quiet_logger() -> None:
    """The parent prints the report; the child's `nandoctor` logger stays silent."""
    import logging

    logger = logging.getLogger("nandoctor")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
