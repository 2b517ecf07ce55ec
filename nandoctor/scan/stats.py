"""Bounded running statistics for the data scan: memory stays flat however long the loader is.

Each object here holds a fixed amount of state, whatever the number of batches: moments are merged
batch by batch (Chan et al.'s parallel form of Welford's update, in float64), scales go into a fixed
log-spaced histogram, and the few places worth naming in a finding are kept in small capped lists or
a top-K heap. `state_size()` counts the stored items so a test can check the state does not grow.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# How many distinct batch shapes, batches, samples and positions a finding keeps: enough to act on.
MAX_SHAPES = 8
MAX_BATCHES = 10
MAX_SAMPLES = 16
MAX_POSITIONS = 5
MAX_VALUES = 10
# Values merged at a time into the running state: the float64 temporaries stay a few MB whatever the batch
PIECE_VALUES = 1 << 20


@dataclass
class Moments:
    """Count, mean, M2, min and max of the finite values seen, merged one batch at a time."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    def add(self, finite: np.ndarray) -> None:
        """Merge a 1-D array of finite values (Chan's formula: exact, and no per-value Python loop)."""
        n = int(finite.size)
        if n == 0:
            return
        x = finite.astype(np.float64, copy=False)
        b_mean = float(x.mean())
        b_m2 = float(((x - b_mean) ** 2).sum())
        self.merge(n, b_mean, b_m2, float(x.min()), float(x.max()))

    def add_block(self, block: np.ndarray, lo: float, hi: float) -> None:
        """Merge an all-finite block whose min and max the caller already has (the chunked fast path).

        float32 blocks are shifted by the running mean (clamped into [lo, hi]) and summed in float32
        (numpy's pairwise sum; einsum for the squares): three passes, no float64 copy, and the
        shifted-data formula keeps the variance to ~1e-5 relative. Overflow falls back to float64.
        Not np.dot: BLAS wakes its thread pool for it, and that cost ~6 ms per call between chunks.
        A block over PIECE_VALUES values (a 100 MB batch checked on its own) is merged a slice of columns
        at a time, so the shifted copy is a few MB, not the block's size again (or twice it in float64).
        """
        if block.ndim == 2 and block.size > PIECE_VALUES:
            step = max(1, PIECE_VALUES // max(1, block.shape[0]))
            for a in range(0, block.shape[1], step):
                self._add_piece(block[:, a:a + step], lo, hi)
            return
        self._add_piece(block, lo, hi)

    def _add_piece(self, block: np.ndarray, lo: float, hi: float) -> None:
        n = int(block.size)
        if n == 0:
            return
        if block.dtype == np.float32:
            c = min(max(self.mean if self.count else float(block.sum(dtype=np.float64)) / n, lo), hi)
            d = np.subtract(block, np.float32(c)).ravel(order="K")
            s1, s2 = float(d.sum()), float(np.einsum("i,i->", d, d))
            if math.isfinite(s1) and math.isfinite(s2):
                self.merge(n, c + s1 / n, max(s2 - s1 * s1 / n, 0.0), lo, hi)
                return
        b_mean = float(block.sum(dtype=np.float64)) / n
        d = np.subtract(block, b_mean, dtype=np.float64).ravel(order="K")
        self.merge(n, b_mean, float(np.einsum("i,i->", d, d)), lo, hi)

    def merge(self, n: int, b_mean: float, b_m2: float, lo: float, hi: float) -> None:
        """Chan's combination of this state with a block's count, mean, M2, min and max."""
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)

    @property
    def std(self) -> float | None:
        return math.sqrt(self.m2 / self.count) if self.count else None


class LogHistogram:
    """A fixed histogram of log10(value) for positive values: a streaming median and spread.

    Bins are 0.02 decades wide from 1e-45 to 1e+39 (float32's range and more), so the median is known
    to within about 5% (plenty for a rule that needs a 1000x gap) in 33 KB per field.
    """

    LO, HI, WIDTH = -45.0, 39.0, 0.02

    def __init__(self) -> None:
        self.bins = np.zeros(int((self.HI - self.LO) / self.WIDTH) + 1, dtype=np.int64)
        self.total = 0

    def _index(self, values: np.ndarray) -> np.ndarray:
        logs = np.log10(np.clip(values.astype(np.float64), 10.0 ** self.LO, 10.0 ** self.HI))
        return np.clip(((logs - self.LO) / self.WIDTH).astype(np.int64), 0, self.bins.size - 1)

    def add(self, values: np.ndarray) -> None:
        """Add positive values; zeros and negatives are the caller's to filter out. PIECE_VALUES at a time:
        the float64 logs of a 100 MB field's per-sample values are a few MB, not several copies of it."""
        for a in range(0, values.size, PIECE_VALUES):
            piece = values[a:a + PIECE_VALUES]
            self.bins += np.bincount(self._index(piece), minlength=self.bins.size)
            self.total += int(piece.size)

    def _centre(self, i: int) -> float:
        return self.LO + (i + 0.5) * self.WIDTH

    def log_median(self) -> float | None:
        if not self.total:
            return None
        cum = np.cumsum(self.bins)
        return self._centre(int(np.searchsorted(cum, (self.total + 1) // 2)))

    def log_mad(self) -> float | None:
        """Median absolute deviation of log10(values), in decades: how wide the healthy spread is."""
        med = self.log_median()
        if med is None:
            return None
        centres = self.LO + (np.arange(self.bins.size) + 0.5) * self.WIDTH
        dev = np.abs(centres - med)
        order = np.argsort(dev, kind="stable")
        cum = np.cumsum(self.bins[order])
        return float(dev[order][int(np.searchsorted(cum, (self.total + 1) // 2))])

    def count_at_least(self, log_threshold: float) -> int:
        """How many values were at or above 10**log_threshold (to within one bin)."""
        start = int((log_threshold - self.LO) / self.WIDTH)
        return int(self.bins[max(start, 0):].sum())

    def state_size(self) -> int:
        return int(self.bins.size)


class TopK:
    """The K largest (value, batch, sample) seen: the outlier candidates kept for the final decision.

    Feeding a chunk of batches at once keeps the same K as feeding them one by one (up to which of
    several equal values at the K-th place is kept).
    """

    def __init__(self, k: int = 64) -> None:
        self.k = k
        self._heap: list[tuple[float, int, int]] = []

    def add(self, values: np.ndarray, batch_index: int) -> None:
        self.add_chunk(values, [batch_index], np.array([0, values.size]))

    def add_chunk(self, values: np.ndarray, batch_ids: list[int], starts: np.ndarray, offset: int = 0) -> None:
        """`values` of several batches back to back; batch i is `values[starts[i]:starts[i + 1]]`, where
        `values` starts at row `offset` of those batches (a piece of a large chunk). PIECE_VALUES at a time,
        so the first fill of the heap sorts a few MB of positions, not a 100 MB batch's."""
        for a in range(0, values.size, PIECE_VALUES):
            self._add_piece(values[a:a + PIECE_VALUES], batch_ids, starts, offset + a)

    def _add_piece(self, values: np.ndarray, batch_ids: list[int], starts: np.ndarray, offset: int) -> None:
        if not values.size:
            return
        if len(self._heap) >= self.k:
            # Most chunks hold nothing above the heap's minimum: one comparison and done.
            pos = np.flatnonzero(values > self._heap[0][0])
            if not pos.size:
                return
        else:
            pos = np.arange(values.size)
        if pos.size > self.k:  # only the chunk's own top k can enter: largest first, ties to the earliest
            pos = np.sort(pos[np.argsort(-values[pos], kind="stable")[:self.k]])
        which = np.searchsorted(starts, pos + offset, side="right") - 1
        for p, i in zip(pos.tolist(), which.tolist()):
            item = (float(values[p]), batch_ids[i], p + offset - int(starts[i]))
            if len(self._heap) < self.k:
                heapq.heappush(self._heap, item)
            elif item[0] > self._heap[0][0]:
                heapq.heapreplace(self._heap, item)

    def items(self) -> list[tuple[float, int, int]]:
        """Largest first."""
        return sorted(self._heap, key=lambda t: (-t[0], t[1], t[2]))

    def state_size(self) -> int:
        return len(self._heap)


@dataclass
class Occurrences:
    """Where one problem showed up in one field: the first batch in detail, later batches in brief."""

    first_batch: int | None = None
    first_samples: list[int] = field(default_factory=list)
    first_positions: list[list[int]] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    n_batches: int = 0
    n_samples: int = 0
    n_values: int = 0
    values: list[Any] = field(default_factory=list)  # a few offending values (bad labels, lengths)

    def add(self, batch_index: int, samples: list[int], n_values: int,
            positions: list[list[int]] | None = None, values: list[Any] | None = None) -> None:
        if self.first_batch is None:
            self.first_batch = batch_index
            self.first_samples = samples[:MAX_SAMPLES]
            self.first_positions = (positions or [])[:MAX_POSITIONS]
        if len(self.batches) < MAX_BATCHES:
            self.batches.append(batch_index)
        self.n_batches += 1
        self.n_samples += len(samples)
        self.n_values += n_values
        for v in values or []:
            if len(self.values) >= MAX_VALUES:
                break
            if v not in self.values:
                self.values.append(v)

    def __bool__(self) -> bool:
        return self.first_batch is not None

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"batches": self.batches, "n_batches": self.n_batches,
                               "n_samples": self.n_samples, "n_values": self.n_values}
        if self.n_batches > len(self.batches):
            out["batches_truncated"] = True
        if self.first_positions:
            out["first_positions"] = self.first_positions
        return out

    def state_size(self) -> int:
        return len(self.first_samples) + len(self.first_positions) + len(self.batches) + len(self.values)


@dataclass
class FieldStats:
    """Everything the scan remembers about one field: dtype, shapes, moments, NaN/Inf counts."""

    name: str
    role: str = "input"  # input | label | other
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    shapes_truncated: bool = False
    moments: Moments = field(default_factory=Moments)
    n_nan: int = 0
    n_inf: int = 0
    n_batches: int = 0
    kind: str = "float"  # float | int | bool | other
    _last_layout: tuple[Any, ...] | None = field(default=None, repr=False, compare=False)

    def note_layout(self, arr: np.ndarray) -> None:
        self.n_batches += 1
        if self._last_layout == (arr.dtype, arr.shape):
            return  # the usual case, a batch like the last one: skip the string and list work
        self._last_layout = (arr.dtype, arr.shape)
        dtype = str(arr.dtype)
        if dtype not in self.dtypes and len(self.dtypes) < MAX_SHAPES:
            self.dtypes.append(dtype)
        shape = [int(s) for s in arr.shape]
        if shape not in self.shapes:
            if len(self.shapes) < MAX_SHAPES:
                self.shapes.append(shape)
            else:
                self.shapes_truncated = True

    def summary(self) -> dict[str, Any]:
        """The JSON-able per-field line of `report.details["fields"]`."""
        m = self.moments
        out: dict[str, Any] = {
            "role": self.role, "kind": self.kind,
            "dtype": self.dtypes[0] if len(self.dtypes) == 1 else self.dtypes,
            "shapes": self.shapes, "batches": self.n_batches, "values": m.count,
            "min": m.min if m.count else None, "max": m.max if m.count else None,
            "mean": m.mean if m.count else None, "std": m.std, "nan": self.n_nan, "inf": self.n_inf,
        }
        if self.shapes_truncated:
            out["shapes_truncated"] = True
        return out

    def state_size(self) -> int:
        return len(self.dtypes) + len(self.shapes)
