"""An epsilon or clamp for the faulting op, applied only while a remedy replay runs.

The guard wraps the Paddle function (and the Tensor method or operator: `x ** p`, `a / b`, `z.exp()`)
and, when the report knows the user's source line that created the op, acts only on calls from that
line, so every other use of the op (and Paddle's own) is untouched. Everything is put back on exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

EPS = 1e-12
EXP_MAX = 60.0  # exp(60) ~ 1e26: a sum over 1e12 such terms still fits float32


@dataclass(frozen=True)
class Guard:
    op: str  # the Paddle op the fault was in (without _grad)
    functions: tuple[str, ...]  # paddle.<name> to wrap
    methods: tuple[str, ...]  # paddle.Tensor.<name> to wrap
    change: str  # the code change to make, as the user would write it


GUARDS = {
    "sqrt": Guard("sqrt", ("sqrt",), ("sqrt",), "paddle.sqrt(x + 1e-12) instead of paddle.sqrt(x)"),
    "rsqrt": Guard("rsqrt", ("rsqrt",), ("rsqrt",), "paddle.rsqrt(x + 1e-12) instead of paddle.rsqrt(x)"),
    "log": Guard("log", ("log",), ("log",), "paddle.log(paddle.clip(x, min=1e-12)) instead of paddle.log(x)"),
    "exp": Guard("exp", ("exp",), ("exp",), "paddle.exp(paddle.clip(z, max=60.0)) instead of paddle.exp(z) (for a "
                 "softmax: subtract the row max first, z - z.max(-1, keepdim=True))"),
    "pow": Guard("pow", ("pow",), ("pow", "__pow__"), "paddle.clip(x, min=1e-12) ** p instead of x ** p (a "
                 "fractional power of a negative value is NaN; clean the negative values at the source too)"),
    "divide": Guard("divide", ("divide",), ("divide", "__truediv__", "__div__"),
                    "num / paddle.clip(den, min=1e-12) instead of num / den (for a count such as mask.sum(): "
                    "num / mask.sum().clip(min=1))"),
    "acos": Guard("acos", ("acos",), ("acos",), "paddle.acos(paddle.clip(x, -1 + 1e-7, 1 - 1e-7)) instead of "
                  "paddle.acos(x)"),
}


def guard_for(op: str | None) -> Guard | None:
    """The guard for a reported op (`sqrt_grad` -> sqrt; `elementwise_div` -> divide), or None."""
    if not op:
        return None
    base = op[:-5] if op.endswith("_grad") else op
    base = {"elementwise_div": "divide", "elementwise_pow": "pow", "div": "divide"}.get(base, base)
    return GUARDS.get(base)


def _guarded_args(op: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    import paddle

    if not args or not isinstance(args[0], paddle.Tensor):
        return args
    x, rest = args[0], args[1:]
    if op in ("sqrt", "rsqrt"):
        return (x + EPS, *rest)
    if op == "log":
        return (paddle.clip(x, min=EPS), *rest)
    if op == "exp":
        return (paddle.clip(x, max=EXP_MAX), *rest)
    if op == "pow":
        return (paddle.clip(x, min=EPS), *rest)
    if op == "acos":
        return (paddle.clip(x, -1 + 1e-7, 1 - 1e-7), *rest)
    if op == "divide" and rest and isinstance(rest[0], paddle.Tensor):
        den = rest[0]
        safe = paddle.where(den.abs() < EPS, paddle.full_like(den, EPS), den)
        return (x, safe, *rest[1:])
    return args


def _at(source: str | None) -> tuple[str, int] | None:
    """'model.py:13 in forward' -> ('model.py', 13)."""
    if not source:
        return None
    head = source.split(" in ", 1)[0]
    name, _, line = head.rpartition(":")
    return (os.path.basename(name), int(line)) if line.isdigit() else None


@contextlib.contextmanager
def guarded(guard: Guard, source: str | None) -> Iterator[dict[str, int]]:
    """Within the block, `guard.op` calls (from `source` when known) get the epsilon/clamp; yields a counter
    of guarded calls, so a replay can tell that the guard was actually reached."""
    import paddle

    where = _at(source)
    hits = {"calls": 0}
    saved: list[tuple[Any, str, Any]] = []

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded_fn(*args: Any, **kwargs: Any) -> Any:
            if where is not None:
                frame = sys._getframe(1)
                if frame.f_lineno != where[1] or os.path.basename(frame.f_code.co_filename) != where[0]:
                    return fn(*args, **kwargs)
            hits["calls"] += 1
            return fn(*_guarded_args(guard.op, args), **kwargs)

        return guarded_fn

    try:
        for name in guard.functions:
            if hasattr(paddle, name):
                saved.append((paddle, name, getattr(paddle, name)))
                setattr(paddle, name, wrap(getattr(paddle, name)))
        for name in guard.methods:
            if hasattr(paddle.Tensor, name):
                saved.append((paddle.Tensor, name, getattr(paddle.Tensor, name)))
                setattr(paddle.Tensor, name, wrap(getattr(paddle.Tensor, name)))
        yield hits
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
