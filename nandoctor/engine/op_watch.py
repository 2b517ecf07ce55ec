"""What a replay sees of an overflowing op beyond the line the report names, and the clamp at the value's source.

A clamp on `exp` at the reported line cannot help when the same value also reaches another `exp` (a VAE's
logvar: exp(0.5 * logvar) in the model, exp(logvar) in its KL term): every threshold fails, and the row said
only "did not help". So the replay without any change watches every call of the op: the largest input at the
reported line on each step (how far a clamp may go without touching the healthy steps), the other calls whose
input overflows too, and the layer whose output the overflowing input is, or is a scaled copy of (where one
clamp covers every call). `clamped_output` is that clamp, for the replay that tries it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.engine.op_guards import EXP_OVERFLOW, Guard, guarded, site

OVERFLOW = {"exp": EXP_OVERFLOW}  # the input beyond which the op's float32 result is inf
SAME_VALUE = 0.999  # correlation of an input with a layer's output for it to be that output, scaled/shifted


@dataclass
class OpWatch:
    """What the watch saw: (step, largest input) at the reported line, the other calls' lines whose input
    overflowed (-> the largest), and the layer the overflowing input came out of."""

    observed: list[tuple[int, float]] = field(default_factory=list)
    others: dict[str, tuple[float, str | None]] = field(default_factory=dict)  # line -> (largest input, its layer)
    layer: str | None = None


@contextlib.contextmanager
def watching(model: Any, guard: Guard, source: str | None, now: list[int], seen: OpWatch,
             from_step: int = 0) -> Iterator[None]:
    """Within the block, every call of `guard.op` is watched into `seen` (nothing is changed); `now[0]` is the
    step running. The calls at `source` are read every step (one host sync each); the others, and the layer
    outputs kept to name the value's source, only from `from_step` on (the fault's): a model with an exp in
    every layer pays for them on the steps that matter only."""
    bound = OVERFLOW.get(guard.op)
    outputs: list[tuple[str, Any]] = []  # this forward's layer outputs, in the order made

    def observe(mine: bool, frame: Any, x: Any) -> None:
        if not mine and (bound is None or now[0] < from_step):
            return
        top = float(x.max())
        if mine:
            seen.observed.append((now[0], top))
            if bound is not None and top > bound and seen.layer is None:
                seen.layer = _made_by(x, outputs)
        elif top > bound:
            at = site(frame)
            before = seen.others.get(at)
            if before is None or top > before[0]:
                seen.others[at] = (top, _made_by(x, outputs) if before is None else before[1])

    with _layer_outputs(model, outputs if bound is not None else None, lambda: now[0] >= from_step), \
            guarded(guard, source, "line" if source else "any", observe=observe):
        yield


@contextlib.contextmanager
def _layer_outputs(model: Any, outputs: list[tuple[str, Any]] | None, wanted: Callable[[], bool]) -> Iterator[None]:
    """Each forward's sublayer outputs (tensors only) into `outputs` while `wanted()`, emptied when the model's
    forward starts."""
    if outputs is None:
        yield
        return
    import paddle

    def start(_layer: Any, _inputs: Any) -> None:
        outputs.clear()

    def keep(name: str) -> Any:
        def hook(_layer: Any, _inputs: Any, out: Any) -> None:
            if isinstance(out, paddle.Tensor) and wanted():
                outputs.append((name, out))

        return hook

    handles = [model.register_forward_pre_hook(start)]
    try:
        handles += [layer.register_forward_post_hook(keep(name)) for name, layer in model.named_sublayers()]
        yield
    finally:
        for h in handles:
            h.remove()
        outputs.clear()


def _made_by(x: Any, outputs: list[tuple[str, Any]]) -> str | None:
    """The layer whose output `x` is, or is an increasing affine copy of (0.5 * logvar), the latest made first;
    None when no layer output of its shape matches."""
    for name, out in reversed(outputs):
        if out is x:
            return name
    want = np.asarray(x.numpy(), dtype=np.float64).ravel()
    import paddle

    for name, out in reversed(outputs):
        if tuple(out.shape) != tuple(x.shape) or not paddle.is_floating_point(out):
            continue
        have = np.asarray(out.numpy(), dtype=np.float64).ravel()
        if _same_value(want, have):
            return name
    return None


def _same_value(a: np.ndarray, b: np.ndarray) -> bool:
    if not (np.isfinite(a).all() and np.isfinite(b).all()) or a.std() == 0 or b.std() == 0:
        return False
    return float(np.corrcoef(a, b)[0, 1]) > SAME_VALUE


@contextlib.contextmanager
def clamped_output(model: Any, clamp: tuple[str, float] | None, hits: list[int],
                   active: Callable[[], bool] | None = None) -> Iterator[None]:
    """Within the block, the output of layer `clamp[0]` is clipped at `clamp[1]`; `hits[0]` counts the forwards
    where that changed a value. `active`: whether the clamp applies now (a replay's change from its step on)."""
    if clamp is None:
        yield
        return
    import paddle

    name, hi = clamp
    layer = dict(model.named_sublayers())[name]

    def hook(_layer: Any, _inputs: Any, out: Any) -> Any:
        if not isinstance(out, paddle.Tensor) or (active is not None and not active()):
            return None
        if bool((out > hi).any()):
            hits[0] += 1
        return paddle.clip(out, max=hi)

    handle = layer.register_forward_post_hook(hook)
    try:
        yield
    finally:
        handle.remove()
