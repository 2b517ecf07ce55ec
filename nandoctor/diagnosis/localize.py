"""Replay of the failing step: which op, in which phase and layer, touching which parameter, from which samples.

Called with the parameters and optimizer state exactly as they were before the failing step (the loop
never stepped the optimizer on it) and the RNG state captured before it. Replays run forward+loss
(+backward) only; gradients are cleared after each, and the Replayer puts buffers (batch-norm running
statistics), RNG states, device and flags back when it is restored, so nothing the user trains on changes.

- forward/loss faults (origin.py): a traced forward names the innermost layer call that turned clean
  inputs (keyword arguments included) into NaN (or a harmful Inf; a mask's intended -inf does not count),
  then the tensor checker in log mode, on during that call only, names the op (the first whose output was
  non-finite: a harmful Inf before the NaN, `log(0)` before `-inf * 0`; the NaN op goes to `nan_op`) and
  a line tracer the user's line.
- backward faults: forward without the checker, then the checker on for backward only (a forward value
  that `where()` discards must not be blamed), for the op; the layer is the innermost sublayer whose
  forward is on the stack Paddle printed for it (frames.py), or none when only the root model's own
  forward is (`model_forward`). One replay without the checker hooks every layer's output and input
  gradients: the parameters with bad gradients, and the layer when the stack names none (the layer whose
  output gradient is finite while its input or parameter gradients are not); never a sublayer when the
  stack shows the op was made in the root's own forward (a sibling that shares the tensor sees its
  gradient too).
- samples: bisection of the batch (samples.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nandoctor.diagnosis import frames, origin
from nandoctor.engine.checker import FLAGS as _FLAGS
from nandoctor.engine.checker import aborted_op, checking, disable_checker, enable_checker, get_flags
from nandoctor.engine.native import capture_native_output
from nandoctor.findings import Phase
from nandoctor.tensors.convert import float_dtypes
from nandoctor.workload.entrypoints import short_path


@dataclass
class Localization:
    phase: Phase
    layer: str | None = None
    op: str | None = None
    parameter: str | None = None
    bad_parameters: list[str] = field(default_factory=list)
    offending: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    # The user's source line that created the offending op ("model.py:23 in forward"), when known.
    source: str | None = None
    # The library line inside it that made the op, when the user's line only called into a library's code
    library_source: str | None = None
    # The op that first made a NaN, when a harmful Inf before it is the fault (`op`): log's -inf, then multiply
    nan_op: str | None = None
    # layer is None because the op was made in the root model's own forward, outside every sublayer
    model_forward: bool = False
    # A backward fault whose op is the gradient of a forward op that made a NaN a later op hid from the loss
    # (Paddle's relu turns NaN into 0): that forward op. The forward was not clean, only the loss was.
    hidden_forward_op: str | None = None
    # A forward fault under a finite loss: what kept its NaN/Inf out of the loss, "model" (an op after the
    # layer, inside the model: its output was finite) or "loss" (the model's output held it; the loss left it out)
    hidden_by: str | None = None


def tensor_stats(t: Any, what: str) -> dict[str, Any] | None:
    """min, max, mean over finite values; NaN/Inf counts; shape and dtype: what a user wants to see. Read a
    chunk of rows at a time (batches.row_chunks): a float64 copy of a large activation, its finite values
    and masks would be several times its size, on top of the replay's own tensors."""
    from nandoctor.tensors.convert import to_numpy
    from nandoctor.tensors.finite import row_chunks

    try:
        shape = [int(d) for d in t.shape]
        if shape and 0 not in shape:
            chunks: Any = (rows for _, rows in row_chunks(t.detach()))
        else:
            chunks = [np.asarray(to_numpy(t.detach().astype("float32")))]
        n_nan = n_inf = count = 0
        total, lo, hi = 0.0, math.inf, -math.inf
        for rows in chunks:
            arr = np.asarray(rows, dtype="float64")
            nan, inf = np.isnan(arr), np.isinf(arr)
            n_nan += int(nan.sum())
            n_inf += int(inf.sum())
            finite = arr[~(nan | inf)]
            if finite.size:
                count += finite.size
                total += float(finite.sum())
                lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    except Exception:  # noqa: BLE001 - stats are a nicety
        return None
    return {"what": what, "shape": shape, "dtype": str(t.dtype).replace("paddle.", ""),
            "numel": math.prod(shape), "num_nan": n_nan, "num_inf": n_inf,
            "min": lo if count else None, "max": hi if count else None, "mean": total / count if count else None}


class Replayer:
    """Re-runs the failing step on a batch (or part of it) with the RNG restored; never steps the optimizer.

    Use it as a context manager (or call `restore()`): on exit, buffers, gradients, the RNG states
    (Paddle's, NumPy's, Python's: the checker reseeds all three), the device and the flags the replays
    touch (the tensor checker's, FLAGS_call_stack_level) are as they were before the first replay."""

    def __init__(self, target: Any, rng: Any) -> None:
        """`target`: a `diagnose.StepTarget` (the model, `replay_loss`, the user's `base_dir`)."""
        import random

        import paddle

        self.w = target
        self.model = target.model
        self.rng = rng
        self.source: str | None = None  # set by the checked replays: the user's line that made the op
        self.library_source: str | None = None  # ... and the library line inside it, when one did
        self.model_forward = False  # set by checked_backward: the op was made in the root's own forward
        self.bad_input_grads: dict[str, Any] = {}
        self.sublayers = list(self.model.named_sublayers())
        self.params = [(n, p) for n, p in self.model.named_parameters() if not p.stop_gradient]
        # Everything the forward itself may change: buffers, and batch norm's running statistics, which
        # Paddle keeps as parameters that take no gradient (so "not a parameter" missed them).
        self._buffers = {k: v.clone() for k, v in self.model.state_dict().items()
                         if k not in {n for n, _ in self.params}}
        self._rng_before = (paddle.get_rng_state(), np.random.get_state(), random.getstate())
        self._device = paddle.get_device()
        self._flags = get_flags(_FLAGS)

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Put buffers (batch-norm running statistics), RNG states, device and flags back as they were."""
        import random

        import paddle

        disable_checker()
        with paddle.no_grad():
            state = self.model.state_dict()
            for k, v in self._buffers.items():
                if k in state:
                    paddle.assign(v, state[k])
        self.clear()
        paddle.set_rng_state(self._rng_before[0])
        np.random.set_state(self._rng_before[1])
        random.setstate(self._rng_before[2])
        if paddle.get_device() != self._device:
            paddle.set_device(self._device)
        if self._flags:
            paddle.set_flags(self._flags)

    def clear(self) -> None:
        for _, p in self.params:
            p.clear_gradient(False)

    def reset_rng(self) -> None:
        import paddle

        if self.rng is not None:
            paddle.set_rng_state(self.rng)

    def loss(self, fields: dict[str, Any]) -> Any:
        return self.w.replay_loss(self.model, fields)

    # ---- forward / loss ------------------------------------------------------------------------
    def trace(self, fields: dict[str, Any]) -> origin.Trace:
        """A plain forward+loss with every layer call's inputs and output classified (origin.py)."""
        self.reset_rng()
        return origin.trace([*self.sublayers, ("", self.model)], lambda: self.loss(fields), _tensors)

    def forward_origin(self, fields: dict[str, Any], tr: origin.Trace) -> Localization:
        """Phase, layer, op and source line of a forward/loss fault, from the call that made it."""
        call = tr.creator()
        self.reset_rng()
        lines, tracer = origin.scoped_ops(self.model, dict(self.sublayers), call, lambda: self.loss(fields),
                                          self.w.base_dir)
        if call is not None:
            masks = call.masked_inputs
        else:  # the loss's span: its inputs are the model's outputs
            root = next((c for c in reversed(tr.calls) if c.name == ""), None)
            masks = root is not None and root.tensor is not None and not origin.all_finite([root.tensor])
        chosen = origin.pick(lines, (call.seek or call.output) if call is not None else None, masks)
        loc = Localization(Phase.FORWARD if call is not None else Phase.LOSS,
                           layer=call.name or None if call is not None else None,
                           op=chosen.op if chosen is not None else None)
        nan_op = origin.first_nan_op(lines)
        if chosen is not None and not chosen.nan and nan_op is not None:
            loc.nan_op = nan_op
        if chosen is not None:
            self.source = tracer.line_at(chosen.offset)
            self.library_source = tracer.library_at(chosen.offset)
        else:
            loc.notes.append("the tensor checker logged no non-finite op in the replay of that span")
        if call is not None and call.tensor is not None:
            what = f"output of layer {call.name}" if call.name else "output of the model's forward"
            loc.offending = tensor_stats(call.tensor, what)
        elif tr.loss is not None:
            loc.offending = tensor_stats(tr.loss, "the loss")
        return loc

    def forward_outputs(self, fields: dict[str, Any], want: str | None) -> tuple[Any, str | None, Any]:
        """A plain forward+loss: (loss, the layer that made a non-finite output, its output).

        Intended non-finite values (mask-like -inf) do not count; "" names the model's own forward."""
        tr = self.trace(fields)
        call = tr.creator()
        if want is not None:
            tensor = next((c.tensor for c in reversed(tr.calls) if c.name == want), None)
            return tr.loss, call.name if call else None, tensor
        return tr.loss, call.name if call else None, call.tensor if call else None

    # ---- backward ------------------------------------------------------------------------------
    def checked_backward(self, fields: dict[str, Any]) -> tuple[str | None, list[str]]:
        """The op the checker names when only backward is checked, and the sublayer(s) whose forward
        created it (frames.py; several when the stack cannot tell instances apart)."""
        import paddle

        self.reset_rng()
        # With the call-stack flag on while the forward runs, each op keeps the Python stack that created
        # it, and the checker prints that stack when the op's gradient turns non-finite: the user's line.
        flag = "FLAGS_call_stack_level"
        old = paddle.get_flags([flag])[flag]
        sites = frames.CallSites()
        hooks = sites.hooks(self.sublayers)
        paddle.set_flags({flag: 3})
        try:
            loss = self.loss(fields)
        finally:
            paddle.set_flags({flag: old})
            for h in hooks:
                h.remove()
        op, layers = None, []
        self.model_forward = False
        try:
            enable_checker()
            try:
                # Keep what Paddle prints (the [PRECISION] line, that stack) instead of printing it.
                with capture_native_output() as native:
                    loss.backward()
            except Exception as exc:  # noqa: BLE001
                op = aborted_op(exc)
                if op is None:
                    raise
                stack = frames.printed_frames(native.text)
                self.source, self.library_source = frames.creation_lines(stack, self.w.base_dir)
                layers = frames.layers_on_stack(stack, self.sublayers, sites)
                self.model_forward = not layers and frames.in_forward_of(stack, self.model)
        finally:
            disable_checker()
            self.clear()
        return op, layers

    def first_nan_backward_op(self, fields: dict[str, Any]) -> str | None:
        """The first backward op whose output holds a NaN, from the checker in log mode."""

        self.reset_rng()
        loss = self.loss(fields)
        try:
            with checking(log_only=True), capture_native_output() as native:
                loss.backward()
        finally:
            self.clear()
        return next((line.op for line in origin.logged_ops(native.text) if line.nan), None)

    def first_nan_forward_op(self, fields: dict[str, Any]) -> tuple[str | None, str | None]:
        """The first op of the model's forward whose output held a NaN, and the user's line that ran it, from
        the checker in log mode over that forward (the step's RNG kept): under a finite loss, a NaN that a
        later op hid from it."""
        whole = origin.LayerCall("", 0, None, None)  # the model's own call: its whole forward
        self.reset_rng()
        lines, tracer = origin.scoped_ops(self.model, dict(self.sublayers), whole, lambda: self.loss(fields),
                                          self.w.base_dir)
        first = next((line for line in lines if line.nan), None)
        return (first.op, tracer.line_at(first.offset)) if first is not None else (None, None)

    def traced_backward(self, fields: dict[str, Any]) -> tuple[str | None, list[str], dict[str, Any] | None]:
        """(layer that turned finite gradients non-finite, parameters with non-finite grads in backward
        order, stats of that layer's offending input gradient)."""
        import paddle

        out_ok: dict[str, bool] = {}
        in_ok: dict[str, bool] = {}
        bad_in_grad: dict[str, Any] = {}
        order: list[str] = []
        hooks: list[Any] = []
        tensor_hooks: list[Any] = []

        def finite(g: Any) -> bool:
            return bool(paddle.isfinite(g).all())

        for name, layer in self.sublayers:
            def pre(_layer: Any, inputs: Any, kwargs: Any, _name: str = name) -> None:
                for t in _tensors(inputs) + _tensors(kwargs):
                    if not t.stop_gradient:
                        def on_grad(g: Any, _n: str = _name) -> None:
                            ok = finite(g)
                            in_ok[_n] = in_ok.get(_n, True) and ok
                            if not ok and _n not in bad_in_grad:
                                bad_in_grad[_n] = g
                        tensor_hooks.append(t.register_hook(on_grad))

            def post(_layer: Any, _inputs: Any, outputs: Any, _name: str = name) -> None:
                for t in _tensors(outputs):
                    if not t.stop_gradient:
                        def on_grad(g: Any, _n: str = _name) -> None:
                            out_ok[_n] = out_ok.get(_n, True) and finite(g)
                        tensor_hooks.append(t.register_hook(on_grad))
                return None

            hooks.append(origin.pre_hook_with_kwargs(layer, pre))
            hooks.append(layer.register_forward_post_hook(post))
        for pname, p in self.params:
            def on_param(g: Any, _n: str = pname) -> None:
                if not finite(g) and _n not in order:
                    order.append(_n)
            tensor_hooks.append(p.register_hook(on_param))
        try:
            self.reset_rng()
            loss = self.loss(fields)
            for h in hooks:
                h.remove()
            hooks = []
            loss.backward()
        finally:
            for h in hooks + tensor_hooks:
                h.remove()
        bad_params = set(order) | {n for n, p in self.params if p.grad is not None and not finite(p.grad)}
        order += [n for n, _ in self.params if n in bad_params and n not in order]
        self.clear()
        candidates = []
        for depth_i, (name, layer) in enumerate(self.sublayers):
            if name not in out_ok or not out_ok[name]:
                continue
            own = {f"{name}.{n}" for n, _ in layer.named_parameters()}
            if not in_ok.get(name, True) or own & bad_params:
                candidates.append((name.count("."), depth_i, name))
        self.bad_input_grads = bad_in_grad  # for a layer named another way (frames.py)
        if not candidates:
            return None, order, None
        layer_name = max(candidates)[2]
        g = bad_in_grad.get(layer_name)
        return layer_name, order, tensor_stats(g, f"gradient of the input of {layer_name}") if g is not None else None


def _first_tensor(outputs: Any) -> Any:
    ts = _tensors(outputs)
    return ts[0] if ts else None


def _tensors(value: Any) -> list[Any]:
    import paddle

    if isinstance(value, paddle.Tensor):
        return [value] if value.dtype in float_dtypes() else []
    if isinstance(value, (tuple, list)):
        out = []
        for v in value:
            out += _tensors(v)
        return out
    if isinstance(value, dict):
        out = []
        for v in value.values():
            out += _tensors(v)
        return out
    return []


def localize(target: Any, fields: dict[str, Any], rng: Any, loss_finite: bool) -> tuple[Localization, Replayer]:
    """Phase, layer, op and parameter of a non-finite loss (forward/loss) or gradient (backward).

    The caller restores the replayer (`with` or `restore()`) once it has also bisected the samples."""
    rp = Replayer(target, rng)
    rp.clear()
    # A layer output can be non-finite while the loss is not (Paddle's CPU softmax clamps NaN logits,
    # cross-entropy skips ignored rows), so the traced forward decides between a forward fault and a
    # pure backward one; masks' intended -inf do not count (origin.py).
    # An Inf that a later where/clip removes before the loss, with no NaN anywhere in the forward, is not
    # the fault: the NaN it leaves in the gradients is (the backward branch names it). An Inf that turned
    # into a NaN on its way (a Linear over -inf) is, even when a ReLU then hides that NaN from the loss.
    tr = rp.trace(fields)
    forward_nan = any(c.output == origin.NAN for c in tr.calls)
    if not loss_finite or (tr.creator() is not None and forward_nan):
        loc = rp.forward_origin(fields, tr)
        loc.source, loc.library_source = rp.source, rp.library_source
        if loss_finite:
            root = next((c for c in reversed(tr.calls) if c.name == ""), None)
            loc.hidden_by = "loss" if root is not None and root.output is not None else "model"
        return _model_called_at(loc, target), rp
    return _model_called_at(_backward_localization(rp, fields), target), rp


def _model_called_at(loc: Localization, target: Any) -> Localization:
    """An op made inside the model's call with no line of the user's code inside the replay (the model and
    the op are a library's, replayed by `nandoctor run` from its own code): the user's line is the one that
    called the model in the step the script ran (`StepTarget.model_caller`)."""
    model_caller = getattr(target, "model_caller", None)
    caller = model_caller() if model_caller is not None else None
    in_model = loc.phase == Phase.FORWARD or loc.layer is not None or loc.model_forward
    if loc.source is None and loc.op is not None and in_model and caller is not None:
        file, line, func = caller
        loc.source = f"{short_path(Path(file), target.base_dir)}:{line} in {func}"
    return loc


@dataclass
class _BackwardLayer:
    """The backward fault's layer as each step settles it (the gradient hooks', then the creation stack's,
    then none for the root's own forward), with the offending gradient's stats and why it moved."""

    layer: str | None
    grad_stats: dict[str, Any] | None
    note: str | None = None  # why the layer is not the one the gradient hooks named


def _backward_localization(rp: Replayer, fields: dict[str, Any]) -> Localization:
    """Op, layer and parameters of a non-finite gradient under a finite loss: the checker's op and creation
    stack, the gradient hooks' layer and parameters, and which of the two names the layer."""
    op, on_stack = rp.checked_backward(fields)
    layer, params, grad_stats = rp.traced_backward(fields)
    # A layer on the stack is the culprit only if a non-finite gradient leaves it (its input's or its
    # parameters'): an Inf its own backward discards (clip's, where's gradient) stops the checker too.
    confirmed = [n for n in on_stack if n in rp.bad_input_grads or any(p.startswith(n + ".") for p in params)]
    notes: list[str] = []
    if on_stack and not confirmed:
        op = _past_discarded_inf(rp, fields, op, on_stack, notes)
    found = _layer_from_stack(rp, confirmed, _BackwardLayer(layer, grad_stats))
    if rp.model_forward and not confirmed:
        _in_model_forward(found, notes)
    loc = Localization(Phase.BACKWARD, layer=found.layer, op=op, parameter=params[0] if params else None,
                       bad_parameters=params, offending=found.grad_stats, source=rp.source,
                       library_source=rp.library_source,
                       model_forward=rp.model_forward and found.layer is None)
    loc.notes += notes
    if found.note:
        loc.notes.append(found.note)
    if op is None:
        loc.notes.append("the tensor checker did not fire on the replayed backward pass")
    loc.hidden_forward_op = _hidden_forward_nan(rp, fields, op)
    return loc


def _hidden_forward_nan(rp: Replayer, fields: dict[str, Any], op: str | None) -> str | None:
    """The forward op of the backward op `op`, when that very op (its name, and the user's line Paddle printed
    for the gradient where known) made the first NaN of the forward and a later op hid it from the finite loss
    (relu(NaN) = 0 in Paddle): the forward was not clean, only the loss was. None when the forward held no NaN,
    or the first was another op's."""
    if not op or not op.endswith("_grad"):
        return None
    forward, line = rp.first_nan_forward_op(fields)
    if forward is None or op != f"{forward}_grad" or rp.source is not None and line != rp.source:
        return None
    return forward


def _past_discarded_inf(rp: Replayer, fields: dict[str, Any], op: str | None, on_stack: list[str],
                        notes: list[str]) -> str | None:
    """The checker stopped at an Inf that the stack's layer's own backward discards: the op is the first
    NaN that reaches the gradients instead (its source line unknown), when the log names another."""
    first_nan = rp.first_nan_backward_op(fields)
    notes.append(f"the checker first stopped at {op} inside {on_stack[-1]}, an Inf that layer's own backward "
                 "discards; the first NaN that reaches the gradients is named instead")
    if first_nan is not None and first_nan != op:
        op, rp.source, rp.library_source = first_nan, None, None
    return op


def _layer_from_stack(rp: Replayer, confirmed: list[str], hooked: _BackwardLayer) -> _BackwardLayer:
    """The layer the op's creation stack names, over the gradient hooks' when they differ (with that
    layer's input gradient as the offending tensor, when it has one)."""
    layer, grad_stats = hooked.layer, hooked.grad_stats
    named = _pick_branch(confirmed, layer)
    if named is None or named == layer:
        return hooked
    g = rp.bad_input_grads.get(named)
    grad_stats = tensor_stats(g, f"gradient of the input of {named}") if g is not None else grad_stats
    if layer is not None:
        note = f"the gradient hooks alone would have named {layer}; the op was created inside {named}'s forward"
    else:
        note = f"the op was created inside {named}'s forward"
    return _BackwardLayer(named, grad_stats, note)


def _in_model_forward(found: _BackwardLayer, notes: list[str]) -> None:
    """The op was made in the root model's own forward, outside every sublayer: the root is the layer (null),
    not a sublayer the gradient hooks saw (a sibling sharing that tensor sees its gradient too)."""
    if found.layer is not None:
        notes.append(f"the op was created in the model's own forward, outside every sublayer; the gradient "
                     f"hooks alone would have named {found.layer}")
    found.layer, found.note = None, None


def _pick_branch(on_stack: list[str], hooked: str | None) -> str | None:
    """The sublayer from the op's creation stack; among instances the stack cannot tell apart, the one the
    gradient hooks point into (else the last one run: backward reaches it first)."""
    if not on_stack:
        return None
    if len(on_stack) == 1 or hooked is None:
        return on_stack[-1]
    for name in on_stack:
        if hooked == name or hooked.startswith(name + ".") or name.startswith(hooked + "."):
            return name
    return on_stack[-1]
