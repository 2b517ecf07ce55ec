"""One model and the optimizer that trains it, watched inside the user's script (`nandoctor run`).

A script may train several models, each with its own optimizer (a GAN's generator and discriminator):
every optimizer it steps gets a `ModelWatch` of its own, with its own `Doctor`, found as the first one is
(runtime.py `Session._attach`). A watch records its model's calls with hooks (inputs, output, the gradient
that comes back to it) and its loss layer's labels, and replays the step's loss from them.

Most steps are not read on the host (the Doctor's spaced reads, inloop/history.py): a fault found at a
later read is rolled back to a snapshot and the unread steps are replayed. For that, each step since the
ring's older snapshot keeps a `_Taped` record: its RNG state before the forward (its dropout masks, as
the script may draw random numbers between steps), and, for loss code written as functions,
the model's outputs, the gradient that came back to them and the loss (so the replay reproduces a loss
or gradient that went non-finite in that code, exactly as the step did).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from nandoctor.tensors.convert import leaves
from nandoctor.zero_change.capture import ROW, batch_rows, input_names, retain_grads

TAPE_BYTES = 64 * 2**20  # the outputs and gradients kept for replays, all together: above, every step is read
_PRUNE_EVERY = 32  # steps between drops of the taped steps the ring can no longer replay
# Read steps on which `_drew` asks whether the step drew random numbers: those whose index is a multiple of this
# (step 0, and every read of a fast step, whose reads fall on multiples of 16; ~75 us on CPU, so a model read
# every step pays it one step in 16)
_DRAW_EVERY = 16


class _Taped:
    """What a replay of one unread step needs beyond its batch (see the module's docstring). The tape keeps
    each step as one flat tuple `(rng, outputs, (index, ...), (gradient, ...), loss, nbytes)`: the garbage
    collector stops tracking a tuple of tensors, so the thousands of steps a 0.3 ms step's ring keeps are not
    walked by its passes (a record object, a list and a dict a step were). Flat: with the gradients as
    (index, gradient) pairs inside it, 119 of 659 entries were still tracked after two full collections
    (fast_mlp under `nandoctor run`, step 3,000; flat, none). Made from the tuple when a replay reads a step."""

    __slots__ = ("rng", "output", "grads", "loss", "nbytes")

    def __init__(self, rng: Any, output: Any, indices: tuple | None, grads: tuple | None, loss: Any,
                 nbytes: int) -> None:
        self.rng = list(rng) if rng is not None else None
        self.output, self.loss, self.nbytes = output, loss, nbytes
        self.grads: dict[int, Any] | None = dict(zip(indices, grads)) if grads is not None else None


class ModelWatch:
    """The state of one watched (model, optimizer) pair; `session` is runtime.py's `Session`."""

    def __init__(self, session: Any, model: Any, optimizer: Any, loss_layer: Any, labels: tuple) -> None:
        self.session = session
        self.model, self.optimizer, self.loss_layer, self.labels = model, optimizer, loss_layer, labels
        self.doctor: Any = None
        self.inputs: tuple = ()
        self.kwargs: dict = {}
        self.output: Any = None
        self._grads: dict[int, Any] = {}  # output leaf index -> the gradient that came back to it
        self._retained: list[tuple[int, Any]] = []  # (index, output leaf) whose gradient is not yet in _grads
        self._leaves: list[Any] = []  # the float tensors of the latest output (loss code written as functions)
        self.names: list[str] = []
        self._layout: tuple | None = None  # (input names, keyword input names, number of labels) of `batch()`
        self.checked = -1  # the session's backward count at this optimizer's last check
        self.handles: list[Any] = []
        self.index = 0  # its position among the models the process watched
        self._rows: Any = None  # the sample positions of the last batch size seen (never written to)
        self._model_raised: tuple = ()  # (type, message) of what the last replay's call of the model raised
        self.call_site: tuple[str, int, str] | None = None  # the user's line that called the model last
        self.rng: Any = None  # the RNG state before the model's latest forward (taped steps only)
        self.random = False  # a step drew random numbers between its forward and its update (dropout): seen at a read
        self._reading = True  # the latest forward's step may be read (not a quiet one)
        self._taped_step: int | None = None  # the step tape_step recorded last
        self.tape: dict[int, tuple] = {}  # step -> what its replay needs (`_Taped`), while steps go unread
        self.tape_bytes = 0
        self._loss_code: bool | None = None

    def start(self, call: Any, report_dir: str | None, sync: Any, on_fault: str, first_step: int = 0) -> None:
        """The Doctor on the model found, with the step whose forward already ran open from its RNG (step
        `first_step`: the optimizer's updates before its model was found)."""
        from nandoctor.findings import Mode
        from nandoctor.inloop.doctor import Doctor

        self.record(call.args, call.kwargs)
        self.call_site = getattr(call, "site", None)
        self.output, self.grads = call.output, call.grads
        self._leaves = leaves(call.output)
        # defer_reads: most steps unread, a fault rolled back and replayed from the tape (the Doctor turns it
        # off under ranks and for skip_step, --keep-going, where every update must be checked before it lands)
        self.doctor = Doctor(self.model, self.optimizer, step_fn=self.replay, report_dir=report_dir,
                             on_fault=on_fault, wrap_step=False, sync=sync, mode=Mode.RUN, defer_reads=True,
                             namer=self.name_batch)
        self.doctor.loss_code_fault = self.loss_code_fault
        self.doctor.on_busy = self.session.replaying
        self.doctor.model_caller = self.model_caller
        self.doctor.replay_failure = self.replay_failed
        self.doctor.replayed_code = "your model and its loss layer" if self.loss_layer is not None else "your model"
        self.doctor.step = first_step
        self.doctor.open_step(call.rng)
        self.rng = tuple(call.rng) if call.rng is not None else None

    @property
    def grads(self) -> dict[int, Any]:
        """The gradient that came back to each output of the model's latest forward that takes one (after its
        backward). Paddle keeps them (`retain_grads`, no Python called inside the backward: ~15 us a step less
        than a hook on a 0.3 ms step); they are taken here, when first asked for after the backward."""
        if self._retained:
            self._take_retained()
        return self._grads

    @grads.setter
    def grads(self, grads: dict[int, Any]) -> None:
        self._grads, self._retained = grads, []

    def _take_retained(self) -> None:
        grads = self._grads
        for i, leaf in self._retained:
            grad = leaf.grad
            if grad is None:
                return  # no backward through the outputs yet: asked again later
            grads[i] = grad
        self._retained = []

    def record(self, args: tuple, kwargs: dict) -> None:
        """A model call's inputs: positional ones named after forward's parameters, keyword ones by keyword."""
        self.inputs = tuple(args)
        self.kwargs = dict(kwargs or {})
        if len(self.names) != len(self.inputs):
            self.names = input_names(self.model, len(self.inputs), self.kwargs)
            self._layout = None

    def hook(self) -> None:
        """Record the model's and the loss layer's calls from now on (the class patch is gone or going)."""
        session = self.session
        doctor = self.doctor
        get_rng_state = sys.modules["paddle"].get_rng_state

        def on_model(layer: Any, args: Any, kwargs: Any) -> None:
            if not session.busy and self.model.training:
                # the call's own tuple and dict (the seam's *inputs, **kwargs): references, no copies
                self.inputs, self.kwargs = args, kwargs
                if len(self.names) != len(args):
                    self.record(args, kwargs)
                session.current = self
                reading = self._reading = doctor is None or doctor.step >= doctor._quiet_until
                if reading:
                    # a step that may be read: the line that called the model (a quiet step's is the same line
                    # in a loop, and only the latest call's is ever reported: a frame walk of ~3 us left out)
                    self.call_site = call_site(sys._getframe(1))
                if doctor is not None and doctor.history is not None:
                    # a replay's dropout masks: the state before the forward, once the step draws random numbers
                    # (a read step takes it to find out: `_drew`); a tuple, which the garbage collector leaves
                    # alone on the tape. On CPU it is the Mersenne twister's whole state, 5 KB a step kept
                    self.rng = tuple(get_rng_state()) if self.random or reading else None
            if doctor is not None:
                doctor._pre_forward(layer, args)  # the doctor's own seam, after ours as when it was under it

        def on_model_out(_layer: Any, _args: Any, out: Any) -> None:
            if session.busy or not self.model.training:
                return
            recheck = session.recheck
            if recheck is not None and recheck.is_model(self.model):
                recheck.after_model(self.doctor.step if self.doctor is not None else 0, self.model, self.inputs,
                                    self.kwargs, out)
            self.output = out
            self._grads = {}
            if self.loss_layer is None:
                self._leaves = leaves(out)
                self._retained = retain_grads(self._leaves)

        def on_loss(_layer: Any, args: Any) -> None:
            if not session.busy:
                self.labels = tuple(args[1:])

        from nandoctor.inloop.forward import ForwardSeam  # (here: every watched process imports this module)

        # seams on the instances' forward, not hooks: a hook sends every call down Paddle's slow path (forward.py).
        # One seam on the model, not ours over the doctor's: its own is taken off and called from ours (one
        # wrapper a forward; its close() then finds ours in place and leaves it to us)
        if doctor is not None:
            doctor._hook.remove()
        self.handles.append(ForwardSeam(self.model, on_model, on_model_out))
        if self.loss_layer is not None:
            self.handles.append(ForwardSeam(self.loss_layer, on_loss))

    def drop(self) -> None:
        """A fork child: this watch was the parent's; its hooks go, nothing is written or synced."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.doctor is not None:
            self.doctor._closed = True
            self.doctor._hook.remove()
            self.doctor.watcher.close()

    def retire(self) -> None:
        """Its optimizer stepped least recently of many: close the watch (the last update is checked)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        try:
            self.doctor.close()
        except Exception:  # noqa: BLE001 - inside the user's loop nothing of ours may raise
            pass

    def release(self) -> None:
        """At exit, after the report: the seams off and every reference to the script's objects and tensors
        dropped (runtime.Session.release)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.doctor = self.model = self.optimizer = self.loss_layer = self.output = self.rng = None
        self.inputs, self.kwargs, self.labels, self.grads, self.tape = (), {}, (), {}, {}

    def model_caller(self) -> tuple[str, int, str] | None:
        """(file, line, function) of the user's line that called the model last: where the step the
        replays re-run called into a library's model (theirs run it from nandoctor's own code)."""
        return self.call_site

    def fields(self) -> dict[str, Any]:
        """The step's batch as named fields (a crash's report)."""
        return self.name_batch(self.batch())[0]

    def batch(self) -> tuple:
        """The step's batch as the doctor keeps it: a flat tuple of references, `(layout, *inputs, *keyword
        inputs, *labels)`, named (`name_batch`) only when a read or a replay needs it, not every step (a
        dict, the batch size, the sample positions); a tuple is kept as it came (history.keep_quiet), and its
        values are the step's own (a new dict per call for the keywords)."""
        kwargs, labels = self.kwargs, self.labels
        layout = self._layout
        if layout is None or len(labels) != layout[2] or (kwargs or layout[1]) and tuple(kwargs) != layout[1]:
            layout = self._layout = (tuple(self.names), tuple(kwargs), len(labels))
        if kwargs:
            return (layout, *self.inputs, *kwargs.values(), *labels)
        return (layout, *self.inputs, *labels)

    def name_batch(self, batch: tuple) -> tuple[dict[str, Any], Any]:
        """A `batch()` as named fields and their rebuild (the doctor's namer): positional inputs named after
        forward's parameters, tensor keyword inputs by keyword, the labels `label` (or `label0`, ...), and
        the sample positions (`ROW`) when every tensor shares one leading dimension."""
        paddle = sys.modules["paddle"]
        names, keys, n_labels = batch[0]
        n, k = len(names), len(keys)
        fields = dict(zip(names, batch[1:1 + n]))
        for key, value in zip(keys, batch[1 + n:1 + n + k]):
            if isinstance(value, paddle.Tensor):
                fields[key] = value
        labels = batch[1 + n + k:]
        if n_labels == 1:
            fields["label"] = labels[0]
        else:
            for i, label in enumerate(labels):
                fields[f"label{i}"] = label
        rows = batch_rows(fields.values())
        if rows is not None:
            if self._rows is None or int(self._rows.shape[0]) != rows:  # (one arange per batch size)
                self._rows = paddle.arange(rows, dtype="int64")
            fields[ROW] = self._rows
        return fields, dict

    def tape_step(self) -> None:
        """Before this step's check, which may leave it unread: what a replay of it needs (`_Taped`). Nothing
        while every step is read (no rollback can come)."""
        history = self.doctor.history
        if history is None or history.ring is None:
            self._taped_step = None
            if self.tape:
                self.tape.clear()
                self.tape_bytes = 0
            return
        step = self.doctor.step
        self._taped_step = step
        rng = self.rng if self.random else None
        loss_code = self._loss_code
        if loss_code is None:
            loss_code = self._functional()
        grads = self.grads if loss_code else None
        if grads:
            nbytes = 0
            for grad in grads.values():
                nbytes += grad._holder_size()
            # detached: the outputs themselves would keep their step's autograd graph alive until dropped
            outs = []
            for out in self._leaves:
                outs.append(out.detach())
            nbytes *= 2  # (the outputs are as large as their gradients)
            self.tape[step] = (rng, tuple(outs), tuple(grads), tuple(grads.values()), self.session.last_loss.detach(),
                               nbytes)
            self.tape_bytes += nbytes
        else:
            self.tape[step] = (rng, None, None, None, None, 0)
        if self.tape_bytes > TAPE_BYTES:
            history.off(f"the model's outputs and their gradients kept for a replay passed "
                        f"{TAPE_BYTES / 2**20:.0f} MB")
        if step % _PRUNE_EVERY == 0:  # the steps before the oldest kept batch (the ring's older snapshot: no replay
            # starts before it); the tape is in step order, as the kept batches are
            from nandoctor.inloop.history import drop_before  # (loaded with the doctor; not at the script's start)

            self.tape_bytes -= drop_before(self.tape, next(iter(history.kept), step), 5)

    def after_update(self) -> None:
        """After the step's update, outside the step time the doctor measures (in it, this comparison's ~75 us
        on the steps the stats schedule times as plain made stats look cheap, and every step was read):
        whether the step drew random numbers, on a read step whose index is a multiple of _DRAW_EVERY, until
        the first draw; that step's tape entry then gets its RNG state too."""
        step = self._taped_step
        if self.random or not self._reading or self.rng is None or step is None or step % _DRAW_EVERY:
            return
        if _drew(self.rng):
            self.random = True
            entry = self.tape.get(step)
            if entry is not None:
                self.tape[step] = (self.rng, *entry[1:])

    def _functional(self) -> bool:
        """The loss is code written as functions (not a loss layer, not the model's own output): its replay
        backpropagates the recorded gradients. Decided at the first step taped."""
        if self._loss_code is None:
            self._loss_code = self.loss_layer is None and self._own_loss(leaves(self.output)) is None
        return self._loss_code

    def _taped(self) -> tuple[_Taped | None, bool]:
        """The taped step a replay runs: the step the rollback replays (and True: its whole batch), else the
        fault's step (a replay of it, or of a subset of its batch, the sample bisection's) and False."""
        if not self.tape:
            return None, False
        history = self.doctor.history
        if history is not None and history.replaying is not None:
            return self.taped(history.replaying), True
        fault = self.doctor.fault
        return (self.taped(fault.step) if fault is not None else None), False

    def taped(self, step: int) -> _Taped | None:
        """What the tape holds of `step`, None when nothing."""
        entry = self.tape.get(step)
        return _Taped(*entry) if entry is not None else None

    def _own_loss(self, outs: list[Any]) -> int | None:
        """The position of the backpropagated loss among the model's outputs (a model that returns its loss)."""
        loss = self.session.last_loss
        return next((i for i, t in enumerate(outs) if t is loss), None)

    def replay(self, model: Any, fields: dict[str, Any]) -> Any:
        """The step's loss from (part of) its batch: the loss layer's, the model's own, or the recorded
        output gradients backpropagated through the model again."""
        import paddle

        from nandoctor.inloop.doctor import ReplayError

        inputs = [fields[n] for n in self.names]
        kwargs = {k: fields.get(k, v) for k, v in self.kwargs.items()}
        taped, whole = self._taped()
        if taped is not None and taped.rng is not None:
            paddle.set_rng_state(taped.rng)  # the step's own dropout masks (the script may draw between steps)
        try:
            out = model(*inputs, **kwargs)
        except Exception as exc:  # (what, not the exception: its traceback would hold the replay's tensors)
            self._model_raised = (type(exc), str(exc))
            raise
        if self.loss_layer is not None:
            labels = [fields[k] for k in fields if k.startswith("label") and k not in kwargs]
            return self.loss_layer(out, *labels)
        outs = leaves(out)
        own = self._own_loss(leaves(self.output))
        if own is not None and own < len(outs):
            return outs[own]
        grads = taped.grads if taped is not None and taped.grads is not None else self.grads
        total = _through_grads(outs, grads, fields.get(ROW))
        if total is None:
            raise ReplayError("no loss to replay: the loss is not a paddle.nn.Layer and no gradient came back to a "
                              "tensor output of the model")
        if whole and taped.grads is not None:
            return _as_taped(total, outs, taped)
        return total

    def replay_failed(self, exc: BaseException) -> str:
        """Why the replay failed, in the terms of a script's user: the call of their model it repeated, what
        that raised and where; a failure of nandoctor's own replay code said to be ours."""
        from nandoctor.inloop.doctor import ReplayError
        from nandoctor.workload.entrypoints import short_path, user_origin

        if isinstance(exc, ReplayError):
            return str(exc)
        text = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        origin = user_origin(exc, Path.cwd())  # (None for a model of a library's: no frame of the user's)
        by_model = self._model_raised == (type(exc), str(exc))
        if not by_model and origin is None:
            return f"nandoctor's own replay failed ({text}); this is a nandoctor bug, please report it"
        args = ", ".join([*self.names, *(f"{k}={k}" for k in self.kwargs)])
        site = ""
        if self.call_site is not None:
            file, line, func = self.call_site
            site = f", as called at {short_path(Path(file), Path.cwd())}:{line} in {func}"
        call = f"{type(self.model).__name__}({args}){site}"
        what = ("calling your model again" if by_model else "calling your loss layer again after your model"
                if self.loss_layer is not None else "replaying the step of your model")
        return (f"{what} with the inputs your script gave it ({call}) raised {text}"
                + (f" at {origin}" if origin else "") + ". The same call ran in your script, so this is a limit of "
                "the replay, not an error in your code: an input may have been changed in place by your script "
                "after the call (an object converted back, reset or reused), or the model depends on state "
                "outside its inputs")

    def loss_code_fault(self, fault: Any) -> Any:
        """A fault that began in loss code written as functions: the model's outputs finite, and the loss
        or the gradient that came back to them not. None when the replay can reach the fault."""
        import math

        import numpy as np

        from nandoctor.diagnosis.diagnose import LossCodeFault
        from nandoctor.findings import Phase
        from nandoctor.tensors.convert import to_numpy

        recorded = self._recorded(fault.step)
        if recorded is None:
            return None
        outs, grads = recorded
        if not all(np.isfinite(to_numpy(t)).all() for t in outs):
            return None  # the model's forward went non-finite: the replay names where
        loss_ok = fault.stats is not None and math.isfinite(fault.stats.loss)
        n = batch_rows(outs)
        bad_grad, rows = _nonfinite_rows(grads, n)
        if loss_ok and not bad_grad:
            return None  # finite loss, finite gradient at the outputs: the fault is in the model's backward
        found = LossCodeFault(phase=Phase.BACKWARD if loss_ok else Phase.LOSS, rows=sorted(rows) or None,
                              batch_size=n)
        session = self.session
        # The checked pass re-runs the whole command: not ours to start on a rank, nor in a child process
        if session.recheck is None and self.doctor.sync is None and session.process is None:
            self._checked_pass(found, fault.step)
        else:
            found.no_pass = ("a rank of a distributed run" if self.doctor.sync is not None else
                             "a child process of your script")
        return found

    def _recorded(self, step: int) -> tuple[list[Any], dict[int, Any]] | None:
        """The model's outputs and the gradients that came back to them at `step` (a fault rolled back to an
        unread step: that step's, from the tape; else the latest), when the loss is code written as functions;
        None for a loss layer or a model that returns its own loss."""
        taped = self.taped(step)
        if taped is not None and taped.grads is not None:
            outs = leaves(taped.output)
            return (outs, taped.grads) if outs and self.loss_layer is None else None
        outs = leaves(self.output)
        if self.loss_layer is not None or not outs or self._own_loss(outs) is not None:
            return None
        return outs, self.grads

    def _checked_pass(self, found: Any, step: int) -> None:
        from nandoctor.findings import Phase
        from nandoctor.zero_change.recheck import run_checked_pass

        answer = run_checked_pass(self.session.config, step, self.model, self.session.started)
        found.samples = answer.get("samples")
        if answer.get("op"):
            found.op, found.source = answer["op"], answer.get("source")
            if answer.get("phase") == "loss":  # a harmful Inf in the loss code's forward came first
                found.phase = Phase.LOSS
            found.notes.append(f"op and line from a checked second pass of the command up to step {step}, "
                               f"with Paddle's tensor checker on after the model's forward ({answer['seconds']} s)")
        else:
            found.notes.append(f"no op named: {answer.get('error')}")
        if answer.get("changed_files"):
            shown = ", ".join(answer["changed_files"][:10])
            found.notes.append(f"the checked pass changed {len(answer['changed_files'])} file(s) in the working "
                               f"folder by a route nandoctor does not redirect (C code): {shown}")


_SITE_DEPTH = 24
_USER: dict[Any, bool] = {}  # code object -> whether it is the user's (is_user_file, asked once per code)


def call_site(frame: Any) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame of the user's code that called a layer (past Paddle's
    machinery, nandoctor's seams, a library's trainer), or None when none is within _SITE_DEPTH frames. Runs
    at every training call of the model: one dict lookup a frame once its code was seen."""
    for _ in range(_SITE_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        user = _USER.get(code)
        if user is None:
            from nandoctor.workload.entrypoints import is_user_path

            user = _USER[code] = is_user_path(code.co_filename)
        if user:
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back
    return None


def _drew(before: Any) -> bool:
    """Whether random numbers were drawn since the RNG state was `before` (the step's forward, loss and
    backward: dropout, a random loss). Only a step that draws needs its state taped for a replay. Asked after
    the update of read steps (`ModelWatch.after_update`) until the first draw (~75 us on CPU, whose state is
    the whole Mersenne twister); step 0 is one, so a model with dropout is seen at its first watched step."""
    after = sys.modules["paddle"].get_rng_state()
    for was, now in zip(before, after):
        if was.__getstate__() != now.__getstate__():
            return True
    return len(before) != len(after)


def _through_grads(outs: list[Any], grads: dict[int, Any], rows: Any) -> Any:
    """The recorded output gradients backpropagated through the replayed outputs (their rows, for a subset):
    sum(output * gradient), None when no gradient came back to an output."""
    import paddle

    total = None
    for i, grad in grads.items():
        if i >= len(outs):
            continue
        if rows is not None and int(rows.shape[0]) != int(grad.shape[0]):
            grad = paddle.gather(grad, rows)
        # NaN/Inf rows came from loss code that is not replayed (`loss_code_fault` named them): the
        # model's own faults show with finite gradients
        grad = paddle.where(paddle.isfinite(grad), grad, paddle.zeros_like(grad))
        term = (outs[i] * grad).sum()
        total = term if total is None else total + term
    return total


def _nonfinite_rows(grads: dict[int, Any], n: int | None) -> tuple[bool, set[int]]:
    """Whether any recorded output gradient is non-finite, and the batch rows where (batch size `n`)."""
    import numpy as np

    from nandoctor.tensors.convert import to_numpy

    rows: set[int] = set()
    bad_grad = False
    for grad in grads.values():
        arr = to_numpy(grad)
        bad = ~np.isfinite(arr)
        if not bad.any():
            continue
        bad_grad = True
        if n is not None and arr.ndim > 0 and arr.shape[0] == n:
            rows.update(np.nonzero(bad.reshape(n, -1).any(axis=1))[0].tolist())
    return bad_grad, rows


def _as_taped(total: Any, outs: list[Any], taped: _Taped) -> Any:
    """The replay of a whole taped step whose loss code went non-finite (its recorded loss, or the gradient
    that came back to the model's outputs): the replay's loss takes the recorded value, and each output gets
    the recorded gradient, NaN/Inf included, so the replay fails as the step did and the rollback names it.
    A step whose model outputs are non-finite fails by itself (the model's own fault): `total` as it is."""
    import numpy as np

    from nandoctor.tensors.convert import to_numpy

    if np.isfinite(to_numpy(taped.loss)).all() and all(np.isfinite(to_numpy(g)).all() for g in taped.grads.values()):
        return total
    if not all(np.isfinite(to_numpy(t)).all() for t in outs):
        return total
    for i, grad in taped.grads.items():
        if i < len(outs) and not outs[i].stop_gradient:
            outs[i].register_hook(lambda _grad, recorded=grad: recorded)
    return taped.loss + (total - total.detach())
