"""The cheap every-step detector: per-layer activation maxima, per-parameter gradient norms, one host sync.

`StepMonitor` owns the forward post-hooks (active only on sampled "stats" steps) and the reductions
that turn a step into one float vector: [loss, parameter-sum of the previous update, data finiteness,
per-parameter squared gradient norms, per-layer max |activation|]. All of it stays on the device until
`read()` concatenates it and calls `.numpy()` once, before `optimizer.step()`.

Why the grouped path: a model of hundreds of tiny layers pays ~5 us of dispatch per Paddle op, so one
reduction per parameter costs more than the 5% budget. Stacking the gradients of each distinct shape
(a deep stack of equal blocks has a handful) and reducing each stack costs a few ops whatever the
parameter count; small models and very large ones take one reduction per tensor.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.tensors.convert import float_dtypes

# map()ped over ~300 gradients a step: no Python frame for each
_is_none = functools.partial(operator.is_, None)
_grad_of = operator.attrgetter("grad")

# Above this many parameter elements, copying every gradient into one buffer costs more than it saves.
_FUSED_MAX_NUMEL = 20_000_000
# Up to this many parameter tensors, one reduction per tensor is cheap next to a step: per-parameter
# gradient norms and the parameter check run every step. Above it (hundreds of tiny layers), each costs
# ~4 us of dispatch per tensor, so they ride on the sampled stats steps and every step pays only for the
# global norm (one stack per distinct parameter shape); a NaN weight still shows in the next loss.
SMALL_MODEL_TENSORS = 96


@dataclass
class StepStats:
    """One step as the host sees it after the single sync."""

    loss: float
    grad_sq: np.ndarray | None  # per trainable parameter (NaN where it has no gradient this step)
    grad_norm: float | None
    params_sum: float | None  # sum of all parameters after the previous update (non-finite => bad update)
    act_max: np.ndarray | None  # per hooked layer, NaN for layers that did not run this step
    loss_scale: float | None = None  # AMP's loss scale (GPU only); gradients above are already unscaled
    pending: np.ndarray | None = None  # the losses of the steps left unread since the last read, in order

    @property
    def grads_finite(self) -> bool:
        return self.grad_norm is None or bool(np.isfinite(self.grad_norm))


@dataclass
class StepMonitor:
    """Hooks and reductions for one model; `close()` removes every hook (always call it, in finally)."""

    model: Any
    param_names: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)
    layer_names: list[str] = field(default_factory=list)
    active: bool = False
    _hooks: list[Any] = field(default_factory=list)
    _layers: list[Any] = field(default_factory=list)
    _hook_fns: list[Any] = field(default_factory=list)
    _act_idx: list[int] = field(default_factory=list)
    _act_val: list[Any] = field(default_factory=list)
    _pending_params: Any = None
    _fused_ok: bool = True
    known_nonfinite: list[str] | None = None  # the start's param_nonfinite(), when the caller already has it
    # Frozen at the start (stop_gradient), and those of them unfrozen since: a layer unfrozen mid-run (a
    # backbone after warm-up) trains from then on, and its gradients count in the global norm
    _frozen: list[tuple[str, Any]] = field(default_factory=list)
    late_names: list[str] = field(default_factory=list)
    late: list[Any] = field(default_factory=list)
    # called whenever the stats hooks go off (`begin_step(False)`: every driver does it before a replay): the
    # precursors' sampled step ends there too, so no measurement of ours runs in a replay under the checker
    on_hooks_off: Any = None

    def __post_init__(self) -> None:
        import paddle

        for name, p in self.model.named_parameters():
            if not p.stop_gradient:
                self.param_names.append(name)
                self.params.append(p)
            else:
                self._frozen.append((name, p))
        self._numel = [math.prod(p.shape) for p in self.params]
        numel = sum(self._numel)
        self._fused_ok = (numel <= _FUSED_MAX_NUMEL and len(self.params) > 0
                          and all(p.dtype == paddle.float32 for p in self.params))
        self.small = len(self.params) <= SMALL_MODEL_TENSORS
        self._all_idx = list(range(len(self.params)))
        from nandoctor.tensors.grouped import by_shape

        self._groups = [(idx, len(key[0])) for key, idx in by_shape(self.params).items()]
        self._group_order = [i for idx, _ in self._groups for i in idx]
        self._grouped = self._fused_ok and not self.small
        self._layers = []
        for name, layer in self.model.named_sublayers():
            self.layer_names.append(name)
            self._layers.append(layer)
        self._hook_fns = [self._make_hook(i) for i in range(len(self._layers))]
        # A parameter that already holds NaN/Inf (a resumed checkpoint with a bad embedding row) would make
        # every sum non-finite and hide the updates: it is left out of the sum (one check, at start).
        # The loop's exact check must not blame an update for these either (frozen ones and buffers included).
        known = self.known_nonfinite
        self.start_nonfinite = set(param_nonfinite(self.model) if known is None else known)
        self._sum_params = [p for n, p in zip(self.param_names, self.params) if n not in self.start_nonfinite]
        if len(self._sum_params) == len(self.params):
            self._sum_params = self.params  # the grouped sum needs every parameter

    def _attach(self, on: bool) -> None:
        """Hooks exist only during stats steps: a registered hook, even one that returns at once, sends
        every layer call down Paddle's slower hooked path (~8 us a layer, 9% of a 500-layer MLP's step)."""
        if on and not self._hooks:
            self._hooks = [layer.register_forward_post_hook(fn) for layer, fn in zip(self._layers, self._hook_fns)]
        elif not on and self._hooks:
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def _make_hook(self, index: int) -> Any:
        # The closure keeps the per-call Python work to a flag test when stats are off, and to two
        # appends when on: no name lookups, no dicts, nothing proportional to the model.
        idx = self._act_idx
        val = self._act_val
        import paddle
        from paddle import _C_ops

        f32 = paddle.float32
        tensor = paddle.Tensor
        floats = float_dtypes()

        def hook(layer: Any, inputs: Any, outputs: Any) -> None:
            if not self.active:
                return None
            if isinstance(outputs, tensor) and outputs.dtype in floats:
                t = outputs
            else:
                t = _first_float_tensor(outputs)
            # `0 not in t.shape`, not `t.size > 0`: Tensor.size costs ~5 us, over a millisecond for 300 layers
            if t is not None and 0 not in t.shape:
                v = _C_ops.max(_C_ops.abs(t.detach()), [], False)  # the bare ops: ~7 us, a third of the API
                idx.append(index)
                val.append(v if v.dtype == f32 else _C_ops.cast(v, f32))
            return None

        return hook

    def begin_step(self, stats: bool) -> None:
        if not stats and self.on_hooks_off is not None:
            self.on_hooks_off()
        self.active = stats
        self._attach(stats)
        self._act_idx.clear()
        self._act_val.clear()

    def close(self) -> None:
        self._attach(False)
        self.active = False

    def after_update(self, check: bool = True) -> None:
        """Queue the parameters' sum for the next read: a NaN/Inf written by the update shows there.

        The loop asks for it after every update on small models; on models of hundreds of tiny tensors
        only before stats steps, as it measured ~7% of a 500-layer MLP's step (benchmarks row 2).
        """
        if not check:
            self._pending_params = None
            return
        import paddle

        with paddle.no_grad():  # parameters require grad: without this each sum builds an autograd graph (2x)
            self._pending_params = self._params_sum()

    def _catch_unfrozen(self) -> None:
        """Move parameters unfrozen since the start to `late` (a loop over the frozen ones only: nothing
        for a model that froze nothing)."""
        moved = [(n, p) for n, p in self._frozen if not p.stop_gradient]
        if moved:
            self._frozen = [(n, p) for n, p in self._frozen if p.stop_gradient]
            self.late_names += [n for n, _ in moved]
            self.late += [p for _, p in moved]

    def _late_sq(self) -> Any:
        """The unfrozen parameters' summed squared gradient norm, one value on the device (None: none)."""
        from paddle import _C_ops

        grads = [p.grad for p in self.late if p.grad is not None]
        if not grads:
            return None
        return _C_ops.reshape(_C_ops.add_n([_C_ops.reshape(_C_ops.squared_l2_norm(g.astype("float32")), [1])
                                            for g in grads]), [1])

    def recheck_grads(self, stats: StepStats) -> bool:
        """After a non-finite norm: are the gradients really non-finite, or did float32's square overflow
        (norms above ~1.8e19)? Recomputes the norms in float64 on the host (rare path, one sync per chunk);
        True when every gradient is finite, and then `stats` holds the exact norms. Each gradient reaches
        the host a few MB at a time (batches.row_chunks): a float64 copy of a large model's gradient, and
        its square, would be several times its size, on top of everything the step holds."""
        sq = np.full(len(self.params), np.nan)
        late = 0.0
        for i, p in enumerate(self.params + self.late):
            if p.grad is None:
                continue
            total = _sum_squares(p.grad)
            if total is None:
                return False
            if i < len(sq):
                sq[i] = total
            else:
                late += total
        stats.grad_sq = sq
        stats.grad_norm = float(np.sqrt(np.nansum(sq) + late))
        return True

    def read_pending_params(self) -> float | None:
        """The last update's parameter sum, read on its own (after the final step: one extra sync); taken
        now when the last update was not queued (deep models queue it only before stats steps)."""
        if self._pending_params is None:
            self.after_update(check=True)
        if self._pending_params is None:  # nothing to sum (every parameter was non-finite from the start)
            return None
        value = float(self._pending_params.numpy()[0])
        self._pending_params = None
        return value

    def _params_sum(self) -> Any:
        import paddle
        from paddle import _C_ops

        if not self._sum_params:
            return None
        if self._grouped and self._sum_params is self.params:
            ps = self.params
            return _C_ops.reshape(_C_ops.add_n([
                _C_ops.sum(ps[idx[0]] if len(idx) == 1 else _C_ops.stack([ps[i] for i in idx], 0), None, None,
                           False) for idx, _ in self._groups]), [1])
        # Bare ops (~5 us each against ~30 us through the Python API): this runs after every update.
        f32 = paddle.float32
        return _C_ops.reshape(_C_ops.add_n([_C_ops.sum(p if p.dtype == f32 else _C_ops.cast(p, f32), None, None, False)
                                            for p in self._sum_params]), [1])

    def _grad_sq(self, per_param: bool) -> tuple[Any, list[int]]:
        """Squared gradient norms as one device tensor (per parameter, or only the global one for a large
        model on a non-stats step), and the parameter index of each value."""
        import paddle
        from paddle import _C_ops

        grads_all = list(map(_grad_of, self.params))
        if any(map(_is_none, grads_all)):  # an unused parameter this step (rare): per-tensor ops
            present = [i for i, g in enumerate(grads_all) if g is not None]
            if not present:
                return None, present
            sq = paddle.concat([_C_ops.squared_l2_norm(grads_all[i].astype("float32")).reshape([1])
                                for i in present])
            return (sq if per_param else sq.sum().reshape([1])), present
        if self._grouped:
            # One stack per distinct shape (a deep stack of equal blocks has a handful): ~0.7 ms for 400
            # tensors where one reduction per tensor costs ~5 ms and a fused copy ~1.5 ms.
            # A shape held by one tensor (the head, say) needs no stack: its norm is a row by itself.
            if not per_param:
                return _C_ops.reshape(_C_ops.add_n([
                    _C_ops.squared_l2_norm(grads_all[idx[0]] if len(idx) == 1 else
                                           _C_ops.stack([grads_all[i] for i in idx], 0))
                    for idx, _ in self._groups]), [1]), self._all_idx
            rows = []
            for idx, nd in self._groups:
                if len(idx) == 1:
                    rows.append(_C_ops.reshape(_C_ops.squared_l2_norm(grads_all[idx[0]]), [1]))
                    continue
                st = _C_ops.stack([grads_all[i] for i in idx], 0)
                rows.append((st * st).sum(axis=list(range(1, nd + 1))) if nd else st * st)
            return _C_ops.concat(rows, 0), self._group_order
        # squared_l2_norm gives shape [1]: one concat, and bare ops (83 -> 44 us for 10 tensors)
        f32 = paddle.float32
        return _C_ops.concat([_C_ops.squared_l2_norm(g if g.dtype == f32 else _C_ops.cast(g, f32))
                              for g in grads_all], 0), self._all_idx

    def read(self, loss: Any, full: bool = True, scale: Any = None, grads: bool = True,
             pending: list[Any] | None = None) -> StepStats:
        """The one host sync of a step: everything queued so far, as numbers. `scale`: AMP's loss-scale
        tensor, read in the same sync; the gradients it multiplied are divided back out. `grads=False`:
        the gradients are left unread this step (grad_norm None; see StepWatcher.defer_grads). `pending`:
        the loss tensors of the steps left unread since the last read (StepWatcher.defer_reads), read in
        the same sync as one stack."""
        has_params = self._pending_params is not None
        per_param = full or self.small
        acts = list(self._act_val)
        act_idx = list(self._act_idx)
        vec, grad_sq, present, late_sq = self._sync(loss, scale, has_params, per_param, grads, acts, pending)
        loss_v = float(vec[0])
        pos = 1
        held = None
        if pending:
            held = vec[pos:pos + len(pending)]
            pos += len(pending)
        loss_scale = None
        if scale is not None:
            loss_scale = float(vec[pos])
            pos += 1
        params_sum = None
        if has_params:
            params_sum = float(vec[pos])
            pos += 1
            self._pending_params = None
        g_full = None
        g_norm = None
        if grad_sq is not None:
            width = len(present) if per_param else 1
            g = vec[pos:pos + width]
            pos += width
            if loss_scale:
                g = g / (loss_scale * loss_scale)
            if per_param:
                # a NaN gradient's norm is non-finite, not absent: inf (as _act_maxima does), or the report's
                # matrix and its plot showed the faulting step's NaN gradients as "not recorded"
                shown = np.where(np.isnan(g), np.inf, g)
                if present is self._all_idx:  # every parameter, in order (the usual case: no scatter)
                    g_full = shown
                else:
                    g_full = np.full(len(self.params), np.nan)  # NaN: no gradient this step
                    g_full[present] = shown
            g_norm = float(np.sqrt(g.sum()))
        if late_sq is not None:  # the unfrozen parameters' share of the global norm
            g_norm = float(np.sqrt((g_norm or 0.0) ** 2 + vec[pos]))
            pos += 1
        act_max = None
        if self.active:
            act_max = self._act_maxima(vec, pos, len(acts), act_idx)
        return StepStats(loss_v, g_full, g_norm, params_sum, act_max, loss_scale, held)

    def _sync(self, loss: Any, scale: Any, has_params: bool, per_param: bool, grads: bool, acts: list[Any],
              pending: list[Any] | None) -> tuple[np.ndarray, Any, list[int], Any]:
        """Everything `read` asks for as one device vector, in the order it takes the values back (the loss and
        the unread steps' losses, stacked together, the loss scale, the parameters' sum, the squared gradient
        norms, the unfrozen ones' share, the activation maxima), then the one host sync; with the gradient
        norms' tensor and the parameter of each, and the unfrozen share's tensor (None where not in the
        vector)."""
        import paddle
        from paddle import _C_ops

        f32 = paddle.float32
        # No autograd here: gradients are tensors that require grad, and every op on them would record a
        # backward node (stacking 150 gradients: 0.2 ms with, 0.06 ms without; a third of a 500-layer
        # MLP's detection cost).
        with paddle.no_grad():
            lv = loss if loss.dtype == f32 else _C_ops.cast(loss, f32)
            if lv.shape not in ([], [1]):  # a scalar needs no sum (~3 us a step)
                lv = _C_ops.sum(lv, None, None, False)
            # with the unread steps' losses: one stack for all (a reshape of the loss, ~10 us, less a read)
            parts: list[Any] = [stacked_losses([lv, *pending]) if pending else _C_ops.reshape(lv, [1])]
            if scale is not None:
                parts.append(_C_ops.reshape(_C_ops.cast(scale, f32), [1]))
            if has_params:
                parts.append(self._pending_params)
            grad_sq, present = self._grad_sq(per_param) if grads else (None, [])
            if grad_sq is not None:
                parts.append(grad_sq)
            if self._frozen and grads:
                self._catch_unfrozen()
            late_sq = self._late_sq() if self.late and grads else None
            if late_sq is not None:
                parts.append(late_sq)
            if acts:
                parts.append(_C_ops.reshape(_C_ops.stack(acts, 0), [-1]))
            vec = _C_ops.concat(parts, 0).numpy().astype("float64")
        return vec, grad_sq, present, late_sq

    def _act_maxima(self, vec: np.ndarray, pos: int, count: int, act_idx: list[int]) -> np.ndarray:
        """A stats step's max |activation| per hooked layer, from the `count` values at `pos` (a layer called
        more than once keeps its largest; NaN for layers that did not run, inf for a NaN activation)."""
        act_max = np.full(len(self.layer_names), np.nan)
        if count:
            vals = vec[pos:pos + count]
            idx = np.asarray(act_idx)
            if len(set(act_idx)) == count:  # each layer called once (the usual case): no slow ufunc.at
                act_max[idx] = vals
            else:
                np.fmax.at(act_max, idx, vals)
            # fmax drops NaN; a NaN activation must still show as non-finite
            bad = ~np.isfinite(vals)
            if bad.any():
                act_max[idx[bad]] = np.inf
        return act_max


def _sum_squares(tensor: Any) -> float | None:
    """The sum of squares of a tensor's values in float64, a chunk of rows at a time (a few MB each); None
    when a value is NaN/Inf."""
    from nandoctor.tensors.convert import to_numpy
    from nandoctor.tensors.finite import row_chunks

    if len(tensor.shape) == 0:
        arr = to_numpy(tensor)
        chunks = [arr.reshape(1, 1)] if arr is not None else []
    else:
        chunks = (rows for _, rows in row_chunks(tensor))
    total = 0.0
    for rows in chunks:
        flat = rows.astype(np.float64).ravel()
        if not np.isfinite(flat).all():
            return None
        total += float(flat @ flat)
    return total


def stacked_losses(losses: list[Any]) -> Any:
    """Scalar loss tensors kept on the device as one float32 vector: one stack when they agree in shape and
    dtype (the usual case), else one reshape and cast each."""
    import paddle
    from paddle import _C_ops

    f32 = paddle.float32
    try:
        out = _C_ops.reshape(_C_ops.stack(losses, 0), [-1])
        if out.shape[0] == len(losses):  # (shapes [] and [1] mixed would stack only by broadcasting)
            return out if out.dtype == f32 else _C_ops.cast(out, f32)
    except Exception:  # noqa: BLE001 - shapes or dtypes that differ (Paddle raises ValueError): one by one
        pass
    return _C_ops.concat([_C_ops.reshape(t if t.dtype == f32 else _C_ops.cast(t, f32), [1]) for t in losses], 0)


def _first_float_tensor(outputs: Any) -> Any:
    """The layer's main output: the tensor itself, or the first floating tensor of a tuple/list."""
    import paddle

    if isinstance(outputs, paddle.Tensor):
        return outputs if outputs.dtype in float_dtypes() else None
    if isinstance(outputs, (tuple, list)):
        for o in outputs:
            if isinstance(o, paddle.Tensor) and o.dtype in float_dtypes():
                return o
    return None




def param_nonfinite(model: Any) -> list[str]:
    """Dotted names of parameters and buffers holding NaN/Inf, in registration order, in one host sync
    and a few ops (not one sync per tensor: ~500 syncs cost 15-25 ms on a deep model, at every start and
    end of a probe; nor two ops per tensor: grouped.py)."""
    import paddle

    floats = float_dtypes()
    items = [(k, t) for k, t in model.state_dict().items()
             if isinstance(t, paddle.Tensor) and t.dtype in floats and 0 not in t.shape]
    if not items:
        return []
    from nandoctor.tensors.grouped import all_finite_rows, per_tensor

    with paddle.no_grad():
        ok = per_tensor([t for _, t in items], all_finite_rows)
    return [k for (k, _), good in zip(items, ok) if good < 0.5]


def read_losses(losses: list[Any]) -> np.ndarray:
    """Kept loss tensors as float64 values, in one host sync (the unread steps at the end of a run)."""
    import paddle

    with paddle.no_grad():
        return stacked_losses(losses).numpy().astype("float64")
