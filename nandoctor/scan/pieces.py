"""A large batch read a piece at a time: the checks' temporaries stay a few MB whatever the batch.

chunks.py groups small batches into one chunk; this is the converse, for a chunk (or a batch checked on
its own) over PIECE_VALUES values: views of consecutive rows, about PIECE_VALUES values each, and what
the NaN/Inf check of one batch gathers from them. A 100 MB batch checked whole made float64 copies,
whole-batch masks and per-sample arrays several times its size (issue 34).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from nandoctor.scan.stats import MAX_POSITIONS, PIECE_VALUES
from nandoctor.tensors.finite import row_chunks


def joined(parts: list[np.ndarray]) -> np.ndarray:
    """Row positions gathered piece by piece, as one array (empty when no piece had any)."""
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def pieces(rows: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) of a (samples, features) view, about PIECE_VALUES values at a time (views, no copy)."""
    return row_chunks(rows, PIECE_VALUES)


@dataclass
class NonFinite:
    """NaN/Inf in one batch of a field: counts, and which samples hold any and which a harmful one."""

    nan: int = 0
    bad: int = 0
    mask_like: bool = True  # every finite value is 0 or <= -1e30: an additive mask, whose -inf is intended
    any_rows: list[int] = field(default_factory=list)
    harm_rows: list[int] = field(default_factory=list)  # rows with a NaN or +inf


def nonfinite_in(rows: np.ndarray) -> NonFinite:
    """The NaN/Inf of a batch's (samples, features) rows, a piece at a time (masks of a piece, never the batch)."""
    out = NonFinite()
    for a, piece in pieces(rows):
        finite = np.isfinite(piece)
        out.nan += int(np.isnan(piece).sum())
        out.bad += int(finite.size - np.count_nonzero(finite))
        if out.mask_like:
            with np.errstate(invalid="ignore"):
                out.mask_like = bool(((piece == 0) | (piece <= -1e30) | ~finite).all())
        bad_rows = np.flatnonzero(~finite.all(axis=1))
        sub = piece[bad_rows]  # only the rows holding a NaN/Inf: few, and small
        out.any_rows += (bad_rows + a).tolist()
        out.harm_rows += (bad_rows[(np.isnan(sub) | (sub == np.inf)).any(axis=1)] + a).tolist()
    return out


def positions(rows: np.ndarray, samples: list[int], trailing: tuple[int, ...], only_harmful: bool) -> list[list[int]]:
    """The first MAX_POSITIONS (sample, *index) of a NaN/Inf (NaN or +inf only, when a mask's -inf is intended)."""
    out: list[list[int]] = []
    for r in samples:
        row = rows[r]
        where = (np.isnan(row) | (row == np.inf)) if only_harmful else ~np.isfinite(row)
        out += [[r, *p] for p in np.argwhere(where.reshape(trailing)).tolist()[:MAX_POSITIONS - len(out)]]
        if len(out) >= MAX_POSITIONS:
            break
    return out
