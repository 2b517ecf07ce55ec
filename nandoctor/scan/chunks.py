"""Many small batches checked as one chunk, with every row still traceable to (batch, sample).

Numpy pays a fixed cost per call, so checking a 256-row batch costs almost as much as checking 16k
rows. `ChunkBuffer` copies consecutive batches with the same layout (field names, dtypes, trailing
shapes) into preallocated slabs and hands them to the checks as one `Chunk`; `Chunk.starts` keeps where
each batch begins, so a finding still names its batch and its sample inside that batch.

The copy is needed anyway: a loader may reuse its buffers. Slabs are stored transposed, one row per
feature and one column per sample (`(features, rows)`), because numpy reduces over a long contiguous
axis many times faster than over 32 values per sample; `Chunk.rows(name)` gives the usual
`(samples, features)` view. Memory is bounded: at most `max_rows` samples and `max_bytes` per chunk.
A batch that does not fit (a different layout, scalars, strings, rows bigger than the buffer) is
checked on its own as a one-batch chunk, after the pending chunk, so batch order is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

MAX_ROWS = 8192
MAX_BYTES = 4 << 20


@dataclass
class Chunk:
    """Consecutive batches, field by field as `(features, rows)` blocks; batch i is rows starts[i]:starts[i+1]."""

    ids: list[int]  # batch index of each batch, in loader order
    blocks: dict[str, np.ndarray]  # numeric fields only
    trailing: dict[str, tuple[int, ...] | None]  # each field's per-sample shape; None for a 0-d field
    starts: dict[str, np.ndarray]  # per field (a lone batch's fields may disagree on their length)
    originals: dict[str, np.ndarray | None] | None = None  # a lone batch's arrays as the loader gave them

    def rows(self, name: str) -> np.ndarray:
        return self.blocks[name].T

    def batch(self, name: str, i: int) -> np.ndarray:
        """Field `name` of the chunk's i-th batch, in the batch's own shape."""
        if self.originals is not None:
            arr = self.originals[name]
            assert arr is not None
            return arr
        s, e = self.starts[name][i], self.starts[name][i + 1]
        return self.blocks[name][:, s:e].T.reshape((int(e - s), *self.trailing[name]))  # type: ignore[misc]

    def batch_arrays(self, i: int) -> dict[str, np.ndarray | None]:
        """All array fields of the chunk's i-th batch (views: copy before the buffer is refilled)."""
        if self.originals is not None:
            return dict(self.originals)
        return {name: self.batch(name, i) for name in self.blocks}

    def batches_with(self, name: str, row_flags: np.ndarray) -> list[int]:
        """Which of the chunk's batches (positions in `ids`) hold a flagged row of field `name`."""
        return self.batches_at(name, np.flatnonzero(row_flags))

    def batches_at(self, name: str, rows: np.ndarray) -> list[int]:
        """Which of the chunk's batches (positions in `ids`) hold the given rows of field `name`."""
        if not rows.size:
            return []
        return np.unique(np.searchsorted(self.starts[name], rows, side="right") - 1).tolist()


def lone_chunk(batch_index: int, arrays: dict[str, np.ndarray | None]) -> Chunk:
    """One batch as a chunk of one, without a copy: the checks then read the loader's own arrays."""
    blocks, trailing, starts = {}, {}, {}
    for name, arr in arrays.items():
        if arr is None or arr.dtype.kind not in "fiub":
            continue
        rows = arr.reshape(1, -1) if arr.ndim == 0 else arr.reshape(arr.shape[0], -1)
        blocks[name] = rows.T
        trailing[name] = None if arr.ndim == 0 else tuple(arr.shape[1:])
        starts[name] = np.array([0, rows.shape[0]])
    return Chunk([batch_index], blocks, trailing, starts, originals=arrays)


@dataclass
class ChunkBuffer:
    """Pending batches of one layout in fixed slabs; `take()` empties it into a Chunk."""

    max_rows: int = MAX_ROWS
    max_bytes: int = MAX_BYTES
    _layout: tuple[Any, ...] | None = None
    _slabs: dict[str, np.ndarray] = field(default_factory=dict)
    _trailing: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _capacity: int = 0
    _ids: list[int] = field(default_factory=list)
    _starts: list[int] = field(default_factory=lambda: [0])

    def __len__(self) -> int:
        return len(self._ids)

    @staticmethod
    def layout(arrays: dict[str, np.ndarray | None], n: int) -> tuple[Any, ...] | None:
        """The batch's layout key, or None when it cannot be buffered (checked on its own instead)."""
        key = []
        for name, arr in arrays.items():
            if arr is None:
                key.append((name, None))
                continue
            if arr.dtype.kind not in "fiub" or arr.ndim == 0 or arr.shape[0] != n:
                return None
            key.append((name, arr.dtype, arr.shape[1:]))
        return tuple(key)

    def fits(self, layout: tuple[Any, ...], n: int) -> bool:
        """Whether a batch of this layout and size can join the pending ones (else: take() first)."""
        if layout != self._layout:
            return False
        return self._starts[-1] + n <= self._capacity

    def can_hold(self, layout: tuple[Any, ...], n: int) -> bool:
        """Whether an empty buffer could take this batch at all (huge rows are checked on their own)."""
        return n <= self.max_rows and n * _row_bytes(layout) <= self.max_bytes

    def add(self, batch_index: int, arrays: dict[str, np.ndarray | None], layout: tuple[Any, ...],
            n: int) -> bool:
        """Copy the batch in (the caller has checked `fits`, or emptied it and checked `can_hold`).

        Returns whether the buffer is now full (time to `take()`).
        """
        if layout != self._layout:
            assert not self._ids
            self._allocate(layout)
        at = self._starts[-1]
        for name, slab in self._slabs.items():
            arr = arrays[name]
            assert arr is not None
            np.copyto(slab[:, at:at + n], arr.reshape(n, -1).T)
        self._ids.append(batch_index)
        self._starts.append(at + n)
        return at + n >= self._capacity

    def take(self) -> Chunk | None:
        """The pending batches as a Chunk of views into the slabs (valid until the next `add`)."""
        if not self._ids:
            return None
        n = self._starts[-1]
        starts = np.array(self._starts)
        chunk = Chunk(self._ids, {name: slab[:, :n] for name, slab in self._slabs.items()},
                      dict(self._trailing), {name: starts for name in self._slabs})
        self._ids, self._starts = [], [0]
        return chunk

    def _allocate(self, layout: tuple[Any, ...]) -> None:
        self._layout = layout
        fields = _array_fields(layout)
        self._capacity = max(1, min(self.max_rows, self.max_bytes // _row_bytes(layout)))
        self._slabs = {name: np.empty((prod(shape), self._capacity), dtype) for name, dtype, shape in fields}
        self._trailing = {name: tuple(shape) for name, _, shape in fields}


def _array_fields(layout: tuple[Any, ...]) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    return [entry for entry in layout if len(entry) == 3]


def _row_bytes(layout: tuple[Any, ...]) -> int:
    return max(sum(prod(shape) * dtype.itemsize for _, dtype, shape in _array_fields(layout)), 1)
