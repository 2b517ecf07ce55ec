"""What `nandoctor run` records of the model it finds in a user's script: the float tensors of its output
(a tensor, tuple, dict or output object), the gradients that come back to them, the names of its
positional inputs and the batch size. No state: runtime.py keeps it.
"""

from __future__ import annotations

import inspect
from typing import Any

from nandoctor.tensors.convert import leaves

ROW = "nandoctor_row"  # a field of sample positions, so a replay of a subset takes the same rows


def keep_grads(out: Any, into: dict[int, Any]) -> None:
    """Record into `into[i]` the gradient that comes back to each output tensor that takes one."""
    for i, leaf in enumerate(leaves(out)):
        if not leaf.stop_gradient:
            def keep(grad: Any, _i: int = i) -> None:
                into[_i] = grad.detach()

            leaf.register_hook(keep)


def retain_grads(outs: list[Any]) -> list[tuple[int, Any]]:
    """Have Paddle keep the gradient that comes back to each output tensor (`leaves` of the output) that takes
    one (`.grad` after the backward); the (index, tensor) pairs to read it from."""
    kept = []
    for i, leaf in enumerate(outs):
        if not leaf.stop_gradient:
            leaf.retain_grads()
            kept.append((i, leaf))
    return kept


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
