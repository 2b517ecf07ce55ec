"""Values as the checks read them: numpy arrays and Paddle tensors, and which values are floats.

Every check that reads a user's batch or a model's output goes through these, so a bfloat16 tensor, a
ragged list or a string field is handled the same way everywhere.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def not_a_tensor(value: Any) -> str | None:
    """Why a field cannot become a tensor (text, ragged lists), or None when it can."""
    if isinstance(value, (str, bytes)):
        return "text (a str)"
    if isinstance(value, np.ndarray):
        return f"text (a numpy array of dtype {value.dtype})" if value.dtype.kind in "OSU" else None
    if not isinstance(value, (list, tuple)):
        return None
    if any(isinstance(v, (str, bytes)) for v in value):
        return "text (a list of str)"
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        return "a ragged list (rows of different lengths)"
    if arr.dtype.kind in "SU":
        return "text (a nested list of str)"
    if arr.dtype.kind == "O":
        return "a ragged list (rows of different lengths)"
    return None


def array_like(value: Any) -> bool:
    """A numpy array, or a tensor whose `numpy()` gives its values: it has a shape and a dtype too. Only these
    have `numpy()` called: a library object with a method of that name may do something else with it (a
    pgl.Graph's `numpy()` turns the graph back to numpy in place, and the model then refuses it)."""
    if isinstance(value, np.ndarray):
        return True
    return hasattr(value, "shape") and hasattr(value, "dtype") and callable(getattr(value, "numpy", None))


def to_numpy(value: Any) -> np.ndarray | None:
    """A field as a numpy array (no copy for numpy); None for things that are not array-like."""
    if isinstance(value, np.ndarray):
        return value
    if array_like(value):
        if str(getattr(value, "dtype", "")) == "paddle.bfloat16":  # its numpy() is raw uint16 bits
            value = value.astype("float32")
        return np.asarray(value.numpy())
    if isinstance(value, (int, float, bool, list, tuple)):
        try:
            return np.asarray(value)
        except (ValueError, TypeError):
            return None
    return None


def to_tensor(value: Any) -> Any:
    """Numpy arrays and Python numbers -> Paddle tensors on the current device; tensors pass through."""
    import paddle

    if isinstance(value, paddle.Tensor):
        return value
    if isinstance(value, np.ndarray) or isinstance(value, (int, float, list)):
        return paddle.to_tensor(value)
    return value


_FLOATS: tuple[Any, ...] | None = None


def float_dtypes() -> tuple[Any, ...]:
    """The floating dtypes whose values can go NaN/Inf; built once (paddle is imported lazily)."""
    global _FLOATS
    if _FLOATS is None:
        import paddle

        _FLOATS = (paddle.float32, paddle.float16, paddle.bfloat16, paddle.float64)
    return _FLOATS


def leaves(value: Any, depth: int = 0) -> list[Any]:
    """The float tensors of a model's output, in a fixed order: a tensor, a tuple/list, a dict, or an
    output object (a dataclass or any object with attributes, as paddleformers' outputs are)."""
    paddle = sys.modules["paddle"]
    if isinstance(value, paddle.Tensor):  # (every step under `nandoctor run`: the dtypes' tuple made once)
        return [value] if value.dtype in (_FLOATS or float_dtypes()) else []
    if depth > 3 or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return []
    if isinstance(value, (tuple, list)):
        items = list(value)
    elif isinstance(value, dict):
        items = list(value.values())
    elif hasattr(value, "__dict__"):
        items = list(vars(value).values())
    else:
        return []
    out: list[Any] = []
    for item in items:
        out += leaves(item, depth + 1)
    return out
