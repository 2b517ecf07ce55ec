"""Paddle's tensor checker switched on and off without side effects the user would notice.

Enabling it prints a seed line and reseeds Paddle, NumPy and `random`; the replays need it on for one
span at a time (one layer call, the loss, a backward pass) and the flags it sets restored afterwards.
Every switch of nandoctor's goes through here: `enable_checker`/`disable_checker`, or `checking()` for a span.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

_OP_RE = re.compile(r"op=([A-Za-z0-9_]+)")


def aborted_op(exc: BaseException) -> str | None:
    """The op type the checker's abort names ("... in [device=cpu, op=log, ...]"), None for any other error."""
    m = _OP_RE.search(str(exc))
    return m.group(1) if m else None


FLAGS = ("FLAGS_check_nan_inf", "FLAGS_check_nan_inf_level", "FLAGS_call_stack_level", "FLAGS_cudnn_deterministic")


def get_flags(names: tuple[str, ...]) -> dict[str, Any]:
    import paddle

    out = {}
    for name in names:
        try:
            out.update(paddle.get_flags([name]))
        except Exception:  # noqa: BLE001 - a flag this build does not have
            continue
    return out


def enable_checker(log_only: bool = False) -> None:
    """Paddle's tensor checker in abort mode (or log mode); its config prints a seed line to stdout, which
    we swallow (the core never prints), and reseeds NumPy and `random`, which we undo."""
    import contextlib
    import io
    import random

    from paddle.amp import debugging

    states = np.random.get_state(), random.getstate()
    mode = debugging.DebugMode.CHECK_NAN_INF if log_only else debugging.DebugMode.CHECK_NAN_INF_AND_ABORT
    with contextlib.redirect_stdout(io.StringIO()):
        debugging.enable_tensor_checker(debugging.TensorCheckerConfig(enable=True, debug_mode=mode))
    np.random.set_state(states[0])
    random.setstate(states[1])


def disable_checker() -> None:
    """The checker off, whatever was on (a replay that raised, the user's Ctrl-C); a no-op when it was off."""
    try:
        from paddle.amp import debugging

        debugging.disable_tensor_checker()
    except Exception:  # noqa: BLE001 - nothing to undo
        pass


@contextlib.contextmanager
def checking(log_only: bool = False) -> Iterator[None]:
    """The checker on for one span (a loss, a backward pass), and off after it, also when the span raised."""
    enable_checker(log_only)
    try:
        yield
    finally:
        disable_checker()
