"""NaN and Inf in arrays and tensors: which rows hold them, how many, and which are harmful.

Read a few MB of rows at a time, so a 100 MB batch or a 4096 x 4096 gradient never costs a second copy of
itself; an additive attention mask's intended -inf is not counted as harmful.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from nandoctor.tensors.convert import float_dtypes, to_numpy

# A batch is checked for NaN/Inf this many values at a time: the check's temporaries (boolean masks, a
# tensor's rows copied to the host) stay a few MB whatever the batch, not a copy of a 100 MB batch.
CHECK_CHUNK = 1 << 18


def row_chunks(value: Any, values: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows as a 2-D array) of an array or tensor with a first axis, about `values` values at a
    time (CHECK_CHUNK when None): a numpy array's rows are views, a tensor's are copied to the host one chunk
    at a time (never the whole tensor)."""
    shape = tuple(getattr(value, "shape", ()))
    n = int(shape[0])
    per_row = max(1, int(np.prod(shape[1:], dtype=np.int64)))
    step = max(1, (values or CHECK_CHUNK) // per_row)
    for start in range(0, n, step):
        part = value[start:start + step]
        if not isinstance(part, np.ndarray):
            # a tensor's slice is a view, and numpy() of a view copies the whole tensor (Paddle 3.3, 64 MB
            # for each 4 MB slice of a 4096 x 4096 gradient): a compact copy of the slice first
            clone = getattr(part, "clone", None)
            part = to_numpy(clone() if callable(clone) else part)
        yield start, part.reshape(part.shape[0], -1)


def _float_rows(value: Any) -> bool:
    """Whether `value` is an array or tensor of floats with a first axis (what the row checks read)."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "fc" and value.ndim > 0 and value.size > 0
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "numpy") or len(shape) == 0 or 0 in shape:
        return False
    return value.dtype in float_dtypes()


def _integer_tensor(value: Any) -> bool:
    """A tensor (not a numpy array) of integers or booleans: it cannot hold NaN/Inf."""
    if isinstance(value, np.ndarray) or not hasattr(value, "numpy"):
        return False
    dtype = str(getattr(value, "dtype", ""))
    return bool(dtype) and "float" not in dtype and "complex" not in dtype


def nonfinite_rows(value: Any) -> list[int]:
    """Positions along the first axis that hold a NaN or Inf (a batch's samples, a weight's rows); [0] for
    a non-finite scalar; [] for anything that is not array-like. Read a chunk of rows at a time."""
    if not _float_rows(value):  # a scalar, a list, a complex tensor: as numpy
        if _integer_tensor(value):
            return []  # (ids, labels, masks: no copy to learn they hold no NaN)
        value = to_numpy(value)
        if value is None or value.dtype.kind not in "fc" or value.size == 0:
            return []
        if value.ndim == 0:
            return [0] if not np.isfinite(value) else []
    out: list[int] = []
    for start, rows in row_chunks(value):
        bad = ~np.isfinite(rows).all(axis=1)
        out += (np.flatnonzero(bad) + start).tolist()
    return out


def nonfinite_count(value: Any) -> int:
    """How many NaN/Inf values an array or tensor holds, a chunk of rows at a time."""
    if len(getattr(value, "shape", ())) == 0 or not _float_rows(value):
        if _integer_tensor(value):
            return 0
        arr = to_numpy(value)
        return int((~np.isfinite(arr)).sum()) if arr is not None and arr.dtype.kind in "fc" else 0
    return sum(int((~np.isfinite(rows)).sum()) for _, rows in row_chunks(value))


def harmful_rows(value: Any) -> list[int]:
    """Like `nonfinite_rows`, but an additive attention mask's intended -inf does not count: in a field
    whose finite values are all 0 or <= -1e30 (the rule `probe.origin.kind` applies to a model's own
    masks), only NaN and +inf are harmful. A user's batch may carry such a mask on purpose. A chunk of
    rows at a time: a healthy chunk costs one finiteness test, and nothing the size of the batch is made."""
    if not _float_rows(value) or getattr(value.dtype, "kind", "f") == "c":  # (a tensor's dtype has no kind)
        return nonfinite_rows(value)
    nonfinite: list[int] = []  # rows with any NaN/Inf
    harmful: list[int] = []  # rows with a NaN or +inf
    mask_like = True  # every finite value so far is 0 or <= -1e30
    for start, rows in row_chunks(value):
        finite = np.isfinite(rows)
        if finite.all():
            if mask_like:
                mask_like = bool(((rows == 0) | (rows <= -1e30)).all())
            continue
        bad_rows = np.flatnonzero(~finite.all(axis=1))
        nonfinite += (bad_rows + start).tolist()
        sub = rows[bad_rows]  # only the rows holding a NaN/Inf: few, and small
        harmful += (bad_rows[(np.isnan(sub) | (sub == np.inf)).any(axis=1)] + start).tolist()
        if mask_like:
            with np.errstate(invalid="ignore"):
                mask_like = bool(((rows == 0) | (rows <= -1e30) | ~finite).all())
    return harmful if mask_like else nonfinite


def harmful_values(values: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """Where float `values` (with `finite = np.isfinite(values)`) hold a harmful NaN/Inf: every non-finite
    value, but -inf only when the finite ones are not an additive mask's (all 0, or <= -1e30 as
    finfo.min-style fills are). (No copy of the finite values: boolean masks only.)"""
    bad = ~finite
    with np.errstate(invalid="ignore"):
        mask_like = bool(((values == 0) | (values <= -1e30) | bad).all())
    if mask_like:
        bad &= values != -np.inf
    return bad


def harmful_fields(fields: dict[str, Any] | None) -> dict[str, list[int]]:
    """Field -> the samples holding a harmful NaN/Inf (`harmful_rows`), for the fields that have any."""
    rows = {k: harmful_rows(v) for k, v in (fields or {}).items()}
    return {k: r for k, r in rows.items() if r}
