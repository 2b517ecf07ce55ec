"""What `nandoctor run` records of the model it finds in a user's script: the float tensors of its output
(a tensor, tuple, dict or output object), the gradients that come back to them, the names of its
positional inputs and the batch size. No state: runtime.py keeps it.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

from nandoctor.tensors.convert import leaves

ROW = "nandoctor_row"  # a field of sample positions, so a replay of a subset takes the same rows
_SITE_FRAMES = 12  # frames kept above a model call: Paddle's own call and hook frames, then the script's


def keep_grads(out: Any, into: dict[int, Any]) -> None:
    """Record into `into[i]` the gradient that comes back to each output tensor that takes one."""
    for i, leaf in enumerate(leaves(out)):
        if not leaf.stop_gradient:
            def keep(grad: Any, _i: int = i) -> None:
                into[_i] = grad.detach()

            leaf.register_hook(keep)


def input_names(model: Any, n: int, kwargs: dict[str, Any]) -> list[str]:
    """The model's forward parameter names for its positional inputs (`a`, `b`), else x0, x1, ... (never a
    name its keyword inputs already use)."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if len(params) >= n and not any(p.startswith("label") or p == ROW or p in kwargs for p in params[:n]):
        return params[:n]
    return [f"x{i}" for i in range(n)]


def batch_rows(values: Any) -> int | None:
    """The batch size: the one leading dimension every tensor shares, else None."""
    sizes = {int(x.shape[0]) for x in values if hasattr(x, "shape") and len(x.shape) > 0}
    return sizes.pop() if len(sizes) == 1 else None


def caller_frames() -> tuple[tuple[str, int, str], ...]:
    """(file, line, function) of the frames above the caller, innermost first: raw, a few microseconds, so a
    model call's site can be kept; which of them is the script's is worked out only when it is shown."""
    frame = sys._getframe(2)
    out = []
    while frame is not None and len(out) < _SITE_FRAMES:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(out)


def call_site(frames: tuple[tuple[str, int, str], ...]) -> str | None:
    """'train.py:42 in train_step' (relative to the working folder): the innermost frame of the user's own
    code among `caller_frames()`, i.e. the line of their script that called the model."""
    from nandoctor.workload.entrypoints import is_user_file, short_path

    for file, line, func in frames:
        if is_user_file(Path(file), None):
            return f"{short_path(Path(file), Path.cwd())}:{line} in {func}"
    return None
