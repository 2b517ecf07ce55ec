"""An epsilon or clamp for the faulting op, applied only while a remedy replay runs.

The guard wraps the Paddle function (and the Tensor method or operator: `x ** p`, `a / b`, `z.exp()`)
and, when the report knows the user's source line that created the op, acts only on calls from that
line, so every other use of the op (and Paddle's own) is untouched. When the op is made in library code
the user's line only calls into it; the wider scopes act on every call made while that line's call runs
("within"), or on every call ("any"). Each firing is counted, with the line that made it wherever the
guard changed a value, so the report can say where the epsilon belongs. Everything is put back on exit.

The tables (GUARDS, RULES, ALIASES) are data on purpose: a bundle carries them as `op_guards.json`
(`bundle_table`), so its stand-alone reproduce.py applies the very guards the probe verified.
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
EXP_OVERFLOW = 88.72  # exp of more is inf in float32


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


@dataclass(frozen=True)
class Rule:
    """What a guard does to the call's arguments (the first must be a tensor, or the call is left alone).

    "add": args[arg] + value; "clip": paddle.clip(args[arg], lo, hi) (None: no bound on that side);
    "nonzero": entries of args[arg] (a tensor, else the call is left alone) with |v| < value become value.
    """

    kind: str
    arg: int = 0
    value: float | None = None
    lo: float | None = None
    hi: float | None = None


ACOS_EDGE = 1 - 1e-7
RULES = {
    "sqrt": Rule("add", value=EPS),
    "rsqrt": Rule("add", value=EPS),
    "log": Rule("clip", lo=EPS),
    "exp": Rule("clip", hi=EXP_MAX),
    "pow": Rule("clip", lo=EPS),
    "acos": Rule("clip", lo=-1 + 1e-7, hi=ACOS_EDGE),
    "divide": Rule("nonzero", arg=1, value=EPS),
}
# The checker's names for ops a guard covers under another name (`x ** tensor` is elementwise_pow).
ALIASES = {"elementwise_div": "divide", "elementwise_pow": "pow", "div": "divide"}
GRAD_SUFFIX = "_grad"
TABLE_FORMAT = "nandoctor.op_guards/1"


def guard_for(op: str | None) -> Guard | None:
    """The guard for a reported op (`sqrt_grad` -> sqrt; `elementwise_div` -> divide), or None."""
    if not op:
        return None
    base = op[:-len(GRAD_SUFFIX)] if op.endswith(GRAD_SUFFIX) else op
    base = ALIASES.get(base, base)
    return GUARDS.get(base)


def bundle_table() -> dict[str, Any]:
    """GUARDS, RULES and ALIASES as plain JSON data, for a bundle's reproduce.py (which has no nandoctor)."""
    guards = {}
    for op, g in GUARDS.items():
        rule = RULES[op]
        guards[op] = {"functions": list(g.functions), "methods": list(g.methods), "kind": rule.kind,
                      "arg": rule.arg, "value": rule.value, "lo": rule.lo, "hi": rule.hi}
    return {"format": TABLE_FORMAT, "grad_suffix": GRAD_SUFFIX, "aliases": dict(ALIASES), "guards": guards}


def limit_of(op: str) -> float | None:
    """The clamp's upper bound a threshold search may tighten (exp's 60), or None for a guard without one."""
    rule = RULES.get(op)
    return rule.hi if rule is not None and rule.kind == "clip" and rule.hi is not None and rule.lo is None else None


def change_text(guard: Guard, limit: float | None) -> str:
    """The guard's code change with the clamp the replay used (`max=60.0` -> `max=15.0`)."""
    default = limit_of(guard.op)
    if limit is None or default is None:
        return guard.change
    return guard.change.replace(f"max={default}", f"max={limit:g}")


def _rule(op: str, limit: float | None) -> Rule | None:
    rule = RULES.get(op)
    if rule is None or limit is None or limit_of(op) is None:
        return rule
    return Rule(rule.kind, rule.arg, rule.value, rule.lo, float(limit))


def _guarded_args(op: str, args: tuple[Any, ...], limit: float | None = None) -> tuple[Any, ...]:
    import paddle

    rule = _rule(op, limit)
    if rule is None or len(args) <= rule.arg or not isinstance(args[0], paddle.Tensor):
        return args
    x = args[rule.arg]
    if rule.kind == "add":
        new = x + rule.value
    elif rule.kind == "clip":
        new = paddle.clip(x, min=rule.lo, max=rule.hi)
    elif rule.kind == "nonzero" and isinstance(x, paddle.Tensor):
        new = paddle.where(x.abs() < rule.value, paddle.full_like(x, rule.value), x)
    else:
        return args
    return (*args[:rule.arg], new, *args[rule.arg + 1:])


def _changes(op: str, args: tuple[Any, ...], limit: float | None = None) -> bool:
    """Whether the guard alters a value of this call (one host sync: replays are not the hot path)."""
    rule = _rule(op, limit)
    assert rule is not None
    x = args[rule.arg]
    if rule.kind == "add":  # sqrt/rsqrt: the epsilon matters where the input is at (or past) 0
        return bool((x <= 0).any())
    if rule.kind == "clip":
        return bool(((x < rule.lo).any() if rule.lo is not None else False)
                    or ((x > rule.hi).any() if rule.hi is not None else False))
    return bool((x.abs() < rule.value).any())


def site(frame: Any) -> str:
    """'paddleformers/nn/criterion/sft_loss.py:50 in sft_postprocess_loss': a library file by its path
    inside the installed packages, any other file by its name."""
    path = frame.f_code.co_filename.replace("\\", "/")
    for mark in ("site-packages/", "dist-packages/"):
        if mark in path:
            path = path.rsplit(mark, 1)[1]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def _within(frame: Any, where: tuple[str, int]) -> bool:
    while frame is not None:
        if frame.f_lineno == where[1] and os.path.basename(frame.f_code.co_filename) == where[0]:
            return True
        frame = frame.f_back
    return False


def _at(source: str | None) -> tuple[str, int] | None:
    """'model.py:13 in forward' -> ('model.py', 13)."""
    if not source:
        return None
    head = source.split(" in ", 1)[0]
    name, _, line = head.rpartition(":")
    return (os.path.basename(name), int(line)) if line.isdigit() else None


@contextlib.contextmanager
def guarded(guard: Guard, source: str | None, scope: str = "line", limit: float | None = None,
            observe: Callable[[float], None] | None = None,
            active: Callable[[], bool] | None = None) -> Iterator[dict[str, Any]]:
    """Within the block, `guard.op` calls get the epsilon/clamp: those made at `source` (scope "line"),
    those made while the call at `source` runs ("within"), or all of them ("any", also when `source` is
    unknown). Yields {"calls": firings, "sites": {line that made the call: firings that changed a value}},
    so a replay can tell whether the guard was reached at all, and where it mattered. `limit` replaces the
    clamp's upper bound (exp's 60: the threshold search); with `observe`, nothing is changed: every call of
    the op, wherever made, goes to `observe(at_source, frame, input)` (what the healthy steps feed the op, and
    what its other calls get). `active`: whether the guard applies now (a replay's change from its step on)."""
    import paddle

    where = _at(source) if scope != "any" else None
    hits: dict[str, Any] = {"calls": 0, "sites": {}}
    saved: list[tuple[Any, str, Any]] = []

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded_fn(*args: Any, **kwargs: Any) -> Any:
            if active is not None and not active():
                return fn(*args, **kwargs)
            frame = sys._getframe(1)
            mine = True
            if where is not None:
                mine = _within(frame, where) if scope == "within" else \
                    frame.f_lineno == where[1] and os.path.basename(frame.f_code.co_filename) == where[0]
                if not mine and observe is None:
                    return fn(*args, **kwargs)
            new = _guarded_args(guard.op, args, limit)
            if new is args:  # not a tensor call the guard can change (a / 2.0)
                return fn(*args, **kwargs)
            if observe is not None:  # every call, and whether it is the one at `source`
                observe(mine, frame, args[RULES[guard.op].arg])
                return fn(*args, **kwargs)
            hits["calls"] += 1
            if _changes(guard.op, args, limit):
                at = site(frame)
                hits["sites"][at] = hits["sites"].get(at, 0) + 1
            return fn(*new, **kwargs)

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
