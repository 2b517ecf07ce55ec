"""The op-guard remedy when the faulting op is made in library code.

The report's source line is the innermost line of the user's own code; when the op is made inside a
library (a model's loss in PaddleFormers), that line only calls into it, and a guard acting at that line
never fires. A guard that never fired says nothing about the fix, so the replay is run again with the
guard on every call of the op made while that line's call runs, then on every call of the op; the line
where the guard changed a value tells the user where the epsilon belongs. A guard that never fires at all
is not applicable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from nandoctor.engine.op_guards import change_text
from nandoctor.engine.replay import Change, Replay

SCOPES = ("line", "within", "any")


def replay_guard(run: Callable[[Change], Replay], change: Change) -> tuple[Replay, Change]:
    """Replay with the guard at the reported line, widening its scope while it never fired; returns the
    last replay and the change it ran with."""
    r = run(change)
    start = SCOPES.index(change.guard_scope) if change.source else len(SCOPES) - 1
    for scope in SCOPES[start + 1:]:
        if r.guard_calls or r.error is not None:
            break
        change = dataclasses.replace(change, guard_scope=scope)
        r = run(change)
    return r, change


def never_fired(r: Replay, change: Change) -> str | None:
    """The note for a guard that was never applied during the replay, else None."""
    if change.guard is None or r.guard_calls or r.error is not None:
        return None
    where = f" at {change.source}, nor while that call ran, nor anywhere else" if change.source else ""
    return (f"the guard was never applied: no {change.guard.op} on a tensor was called during the replay{where}, "
            "so this replay says nothing about the fix")


def guard_text(change: Change, r: Replay) -> str:
    """Where to put the epsilon: the reported line, or the line inside the library that made the op."""
    base = change_text(change.guard, change.guard_limit) if change.guard is not None else \
        "an epsilon or clamp for the faulting op"
    if change.guard_scope == "line" or not r.guard_calls:
        return f"{base} at {change.source}" if change.source else base
    sites = sorted(r.guard_sites.items(), key=lambda kv: -kv[1])
    mine = f"your call at {change.source}" if change.source else "your code"
    if not sites:
        return f"{base}, in the {change.guard.op} reached from {mine} (the line that made it was not seen)"
    lib = sites[0][0]
    more = f" (and {len(sites) - 1} other line(s))" if len(sites) > 1 else ""
    return (f"{base} at {lib}{more} (library code, reached from {mine}): patch it there, or keep the op's "
            "input off its edge before that call (e.g. skip a batch whose mask or count is zero)")


def scope_note(change: Change, r: Replay) -> str | None:
    """What the widened guard did, for the row's note: the reported line never made the op itself."""
    if change.guard is None or change.guard_scope == "line" or not r.guard_calls or not change.source:
        return None
    how = "while that call ran" if change.guard_scope == "within" else "anywhere in the replay"
    mattered = sum(r.guard_sites.values())
    return (f"the guard never fired at {change.source} (the op is made in code that line calls); applied to "
            f"every {change.guard.op} {how}: {r.guard_calls} call(s), {mattered} of them at the edge")


def guard_info(change: Change, r: Replay) -> dict[str, Any]:
    """The row's evidence that the guard was reached: its scope, firings and the lines where it mattered."""
    return {"scope": change.guard_scope, "calls": r.guard_calls or 0, "sites": dict(r.guard_sites)}


def elsewhere_note(op: str, others: dict[str, tuple[float, str | None]], layer: str | None) -> str | None:
    """Why a clamp at the reported line cannot help: the op's other calls whose input overflowed as well (the
    replay without any change saw them), saying where the value that feeds them is made."""
    if not others:
        return None
    same = [at for at, (_, made) in others.items() if layer is not None and made == layer]
    calls = "; ".join(f"{at} (input up to {top:.3g})" for at, (top, _) in others.items())
    if same:
        what = f"the same value (layer {layer}'s output) overflows {op} at another call too"
    else:
        what = f"another {op} call overflows on the same step too"
    where = f"clamp layer {layer}'s output where it is made (source_clamp)" if layer is not None else \
        "clamp the value where it is made, before it feeds every call"
    return f"{what}: {calls}; a clamp at one call cannot help: {where}"


def source_clamp_text(op: str, layer: str, limit: float, source: str | None,
                      others: dict[str, tuple[float, str | None]]) -> str:
    """The clamp of the layer output that feeds every overflowing call, as the user writes it."""
    calls = [c for c in (source, *others) if c]
    fed = f" (it reaches {op} at {' and at '.join(calls)})" if calls else ""
    return (f"clip layer {layer}'s output where it is made, before it feeds every {op}: "
            f"paddle.clip(self.{layer}(...), max={limit:g}) in the forward that calls it{fed}")
