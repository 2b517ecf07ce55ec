"""A record named by its values: a short hash of each sample of a batch, for loaders with no batch sampler.

A paddle.io.DataLoader's batch sampler names each sample by its dataset index, so a bad record can be left
out in every epoch, wherever the shuffle puts it. A plain list of batches or a generator names nothing: the
same record comes back in the next epoch at another position (or the same one), and only its values say it
is the same. So a sample is named by a fingerprint of its values: blake2b (6 bytes, 12 hex digits) over each
field's row, fields in name order, read a few MB at a time (no copy of the batch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from nandoctor.tensors.convert import to_numpy
from nandoctor.tensors.finite import row_chunks
from nandoctor.tensors.sizes import batch_size

DIGEST_BYTES = 6  # 12 hex digits: a collision among a dataset's records is ~n^2 / 2^49, nil below 10^6 records


def row_fingerprints(fields: Mapping[str, Any]) -> list[str] | None:
    """One fingerprint per sample of the batch (its values in every field with a first axis of the batch's
    size), or None when no field has rows to hash."""
    n = batch_size(fields)
    if not n:
        return None
    hashes = [hashlib.blake2b(digest_size=DIGEST_BYTES) for _ in range(n)]
    used = False
    for name in sorted(fields, key=str):
        rows = _rows_of(fields[name], n)
        if rows is None:
            continue
        used = True
        for start, chunk in rows:
            tag = f"{name}:{chunk.dtype.str}:".encode()
            for i in range(chunk.shape[0]):
                h = hashes[start + i]
                h.update(tag)
                h.update(_row_bytes(chunk[i]))
    return [h.hexdigest() for h in hashes] if used else None


def _rows_of(value: Any, n: int) -> Any:
    """The field's rows a chunk at a time, when its first axis is the batch's (else None: not per sample)."""
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = to_numpy(value)
        shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0 or int(shape[0]) != n:
        return None
    return row_chunks(value)


def _row_bytes(row: np.ndarray) -> bytes:
    if row.dtype.kind == "O":  # (strings, ragged lists as numpy objects: their text)
        return repr(row.tolist()).encode()
    return np.ascontiguousarray(row).tobytes()


def batch_fingerprint(fields: Mapping[str, Any] | None) -> str | None:
    """One fingerprint for a whole batch (its samples' in order), to tell whether a replay read the very batch
    the training read; None when it has no rows to hash."""
    rows = row_fingerprints(fields) if fields else None
    if rows is None:
        return None
    return hashlib.blake2b("".join(rows).encode(), digest_size=8).hexdigest()
