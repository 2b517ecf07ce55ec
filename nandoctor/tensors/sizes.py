"""Sizes and slices of a batch: its leading dimension, and the same batch restricted to some samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def leading_dim(value: Any) -> int | None:
    """The length of a tensor's or array's first axis; None for a scalar or a value with no shape."""
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else None


def batch_size(fields: Mapping[str, Any]) -> int | None:
    """The leading dimension shared by the array fields, or None when they disagree or have none."""
    sizes = {d for d in map(leading_dim, fields.values()) if d is not None}
    return sizes.pop() if len(sizes) == 1 else None


def take(value: Any, indices: list[int]) -> Any:
    """Rows `indices` of a field, keeping its type (tensor or array); other values pass through."""
    import paddle

    if isinstance(value, paddle.Tensor):
        return paddle.gather(value, paddle.to_tensor(indices, dtype="int64"), axis=0)
    if isinstance(value, np.ndarray):
        return value[indices]
    return value


def subset(fields: Mapping[str, Any], indices: list[int]) -> dict[str, Any]:
    """The same batch restricted to some samples; fields without a batch dimension are kept whole."""
    n = batch_size(fields)
    out = {}
    for k, v in fields.items():
        d = leading_dim(v)
        out[k] = take(v, indices) if d is not None and d == n else v
    return out
