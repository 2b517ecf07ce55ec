"""Replay of the failing step: which op, in which phase and layer, touching which parameter, from which samples.

Called with the parameters and optimizer state exactly as they were before the failing step (the loop
never stepped the optimizer on it) and the RNG state captured before it. Replays run forward+loss
(+backward) only; gradients are cleared after each and buffers (batch-norm running statistics) are
restored at the end, so nothing the user trains on is changed.

- forward/loss faults: one replay under Paddle's tensor checker with a stack of running layers; the op
  is parsed from the checker's exception and the innermost running layer is the culprit (none: loss).
- backward faults: forward without the checker, then the checker on for backward only (a forward value
  that `where()` discards must not be blamed), for the op; and one replay without the checker that
  hooks every layer's output and input gradients, for the layer whose output gradient is finite while
  its input or parameter gradients are not.
- samples: bisection of the batch (samples.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.entrypoints import user_origin
from nandoctor.findings import Phase
from nandoctor.probe.monitors import float_dtypes
from nandoctor.probe.native import capture_native_output, user_frame

_OP_RE = re.compile(r"op=([A-Za-z0-9_]+)")


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


def tensor_stats(t: Any, what: str) -> dict[str, Any] | None:
    """min, max, mean over finite values; NaN/Inf counts; shape and dtype: what a user wants to see."""
    try:
        arr = np.asarray(t.detach().astype("float32").numpy(), dtype="float64")
    except Exception:  # noqa: BLE001 - stats are a nicety
        return None
    finite = arr[np.isfinite(arr)]
    return {"what": what, "shape": list(arr.shape), "dtype": str(t.dtype).replace("paddle.", ""),
            "numel": int(arr.size), "num_nan": int(np.isnan(arr).sum()), "num_inf": int(np.isinf(arr).sum()),
            "min": float(finite.min()) if finite.size else None, "max": float(finite.max()) if finite.size else None,
            "mean": float(finite.mean()) if finite.size else None}


class Replayer:
    """Re-runs the failing step on a batch (or part of it) with the RNG restored; never steps the optimizer."""

    def __init__(self, workload: Any, rng: Any) -> None:
        self.w = workload
        self.model = workload.model
        self.rng = rng
        self.source: str | None = None  # set by the checked replays: the user's line that made the op
        self.sublayers = list(self.model.named_sublayers())
        self.params = [(n, p) for n, p in self.model.named_parameters() if not p.stop_gradient]
        self._buffers = {k: v.clone() for k, v in self.model.state_dict().items()
                         if k not in {n for n, _ in self.model.named_parameters()}}

    def restore(self) -> None:
        """Put buffers (batch-norm running statistics) back as they were before the first replay."""
        import paddle

        with paddle.no_grad():
            state = self.model.state_dict()
            for k, v in self._buffers.items():
                if k in state:
                    paddle.assign(v, state[k])
        self.clear()

    def clear(self) -> None:
        for _, p in self.params:
            p.clear_gradient(False)

    def reset_rng(self) -> None:
        import paddle

        if self.rng is not None:
            paddle.set_rng_state(self.rng)

    def loss(self, fields: dict[str, Any]) -> Any:
        return self.w.compute_loss(self.model, fields)

    # ---- forward / loss ------------------------------------------------------------------------
    def checked_forward(self, fields: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
        """(op, innermost running layer, error text) from a forward+loss under the tensor checker."""
        from paddle.amp import debugging

        stack: list[str] = []
        hooks = self._stack_hooks(stack)
        op = layer = text = None
        try:
            _enable_checker()
            self.reset_rng()  # the checker reseeds: restore the step's RNG after enabling it
            try:
                with capture_native_output():  # the checker's [PRECISION] line: the core never prints
                    self.loss(fields)
            except Exception as exc:  # noqa: BLE001 - the checker's abort is what we are after
                text = str(exc)
                m = _OP_RE.search(text)
                if m:
                    op = m.group(1)
                    layer = stack[-1] if stack else None  # "" is the model's own forward
                    self.source = user_origin(exc, self.w.spec.base_dir)
                else:
                    raise
        finally:
            debugging.disable_tensor_checker()
            for h in hooks:
                h.remove()
            self.clear()
        return op, layer, text

    def _stack_hooks(self, stack: list[str]) -> list[Any]:
        hooks = []
        for name, layer in [("", self.model), *self.sublayers]:
            def pre(_layer: Any, _inputs: Any, _name: str = name) -> None:
                stack.append(_name)

            def post(_layer: Any, _inputs: Any, _outputs: Any, _name: str = name) -> None:
                # pop back to this layer: an exception inside a sublayer left its name on the stack
                while stack and stack[-1] != _name:
                    stack.pop()
                if stack:
                    stack.pop()

            hooks.append(layer.register_forward_pre_hook(pre))
            hooks.append(layer.register_forward_post_hook(post))
        return hooks

    def forward_outputs(self, fields: dict[str, Any], want: str | None) -> tuple[Any, str | None, Any]:
        """A plain forward+loss: (loss, first layer whose output was non-finite, that output or `want`'s)."""
        import paddle

        first: list[tuple[str, Any]] = []
        chosen: list[Any] = []
        hooks = []
        for name, layer in [*self.sublayers, ("", self.model)]:  # "": the model's own output
            def post(_layer: Any, _inputs: Any, outputs: Any, _name: str = name) -> None:
                t = _first_tensor(outputs)
                if t is None:
                    return None
                if _name == want:
                    chosen.append(t)
                if not first and not bool(paddle.isfinite(t).all()):
                    first.append((_name, t))
                return None

            hooks.append(layer.register_forward_post_hook(post))
        try:
            self.reset_rng()
            with paddle.no_grad():
                loss = self.loss(fields)
        finally:
            for h in hooks:
                h.remove()
        bad_layer = first[0][0] if first else None
        tensor = chosen[-1] if chosen else (first[0][1] if first else None)
        return loss, bad_layer, tensor

    # ---- backward ------------------------------------------------------------------------------
    def checked_backward(self, fields: dict[str, Any]) -> str | None:
        """The op the checker names when only backward is checked."""
        import paddle
        from paddle.amp import debugging

        self.reset_rng()
        # With the call-stack flag on while the forward runs, each op keeps the Python stack that created
        # it, and the checker prints that stack when the op's gradient turns non-finite: the user's line.
        flag = "FLAGS_call_stack_level"
        old = paddle.get_flags([flag])[flag]
        paddle.set_flags({flag: 3})
        try:
            loss = self.loss(fields)
        finally:
            paddle.set_flags({flag: old})
        op = None
        try:
            _enable_checker()
            try:
                # Keep what Paddle prints (the [PRECISION] line, that stack) instead of printing it.
                with capture_native_output() as native:
                    loss.backward()
            except Exception as exc:  # noqa: BLE001
                m = _OP_RE.search(str(exc))
                if not m:
                    raise
                op = m.group(1)
                self.source = user_frame(native.text, self.w.spec.base_dir)
        finally:
            debugging.disable_tensor_checker()
            self.clear()
        return op

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
            def pre(_layer: Any, inputs: Any, _name: str = name) -> None:
                for t in _tensors(inputs):
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

            hooks.append(layer.register_forward_pre_hook(pre))
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
        if not candidates:
            return None, order, None
        layer_name = max(candidates)[2]
        g = bad_in_grad.get(layer_name)
        return layer_name, order, tensor_stats(g, f"gradient of the input of {layer_name}") if g is not None else None


def _enable_checker() -> None:
    """Paddle's tensor checker in abort mode; its config prints a seed line to stdout, which we swallow
    (the core never prints)."""
    import contextlib
    import io

    from paddle.amp import debugging

    with contextlib.redirect_stdout(io.StringIO()):
        debugging.enable_tensor_checker(debugging.TensorCheckerConfig(
            enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT))


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


def localize(workload: Any, fields: dict[str, Any], rng: Any, loss_finite: bool) -> tuple[Localization, Replayer]:
    """Phase, layer, op and parameter of a non-finite loss (forward/loss) or gradient (backward)."""
    rp = Replayer(workload, rng)
    rp.clear()
    # A layer output can be non-finite while the loss is not (Paddle's CPU softmax clamps NaN logits),
    # so a plain forward with output hooks decides between a forward fault and a pure backward one.
    _, first_bad, _ = rp.forward_outputs(fields, None)
    if not loss_finite or first_bad is not None:
        op, layer, _ = rp.checked_forward(fields)
        loss, bad_layer, tensor = rp.forward_outputs(fields, layer or None)
        loc = Localization(Phase.FORWARD if layer is not None else Phase.LOSS, layer=layer or None, op=op)
        if op is None:  # the checker did not fire (a non-deterministic op?): fall back to the hooks' view
            loc.layer = bad_layer or None
            loc.phase = Phase.FORWARD if bad_layer is not None else Phase.LOSS
            loc.notes.append("the tensor checker did not fire on the replay; the layer comes from output hooks")
        elif bad_layer is not None and layer and bad_layer != layer and not layer.startswith(bad_layer):
            loc.notes.append(f"the first layer whose output was non-finite was {bad_layer}")
        loc.source = rp.source
        if loc.layer is not None and tensor is not None:
            loc.offending = tensor_stats(tensor, f"output of layer {loc.layer}")
        elif loss is not None:
            loc.offending = tensor_stats(loss, "the loss")
        return loc, rp
    op = rp.checked_backward(fields)
    layer, params, grad_stats = rp.traced_backward(fields)
    loc = Localization(Phase.BACKWARD, layer=layer, op=op, parameter=params[0] if params else None,
                       bad_parameters=params, offending=grad_stats, source=rp.source)
    if op is None:
        loc.notes.append("the tensor checker did not fire on the replayed backward pass")
    return loc, rp
