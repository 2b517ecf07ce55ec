"""The batches the probe's loop read, kept for its replays, so a replay does not re-read the user's loader.

A remedy or rollback replay restarts from a snapshot several steps before the fault. Re-reading the
loader from batch 0 for each replay calls the user's dataset again (nine times for one probe) and, for a
stream (an IterableDataset over a queue, a generator that goes on where it stopped), yields other data:
no replay then sees the faulty batch, and its verdict is worthless. So the probe's loop reads through a
`BatchTape`: every batch it yields is kept (host references to what the loader returned, no copies), up
to `KEPT_FLOOR` or one batch's size, whichever is larger, and never above `KEPT_BYTES` (the oldest go
first), with the dataset indices a paddle.io.DataLoader's batch sampler gave it (the records, for
dropping a bad record in every epoch). A replay reads the kept batches; past them (the steps after the
fault, or before the oldest kept one) it makes one fresh loader, checks that it yields the kept batches
again on the way (else the loader is a stream: `stream` says so and the replays end with the kept
batches), and keeps what it reads there for the next replay.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import numpy as np

from nandoctor.engine.interrupt import stop_loader

KEPT_BYTES = 64 * 2**20  # all kept batches together, at most; the oldest are let go first
KEPT_FLOOR = 8 * 2**20  # ...and at most this or one (the first) batch's size, whichever is larger: large batches
# fill memory (a plain loop holds one), so of 16 MB batches one is kept, an extra ~4% on the wide_batch benchmark
END = object()  # yielded (with the epoch and batch count) where an epoch's loader ended


class BatchTape:
    """Batches by (epoch, batch_index), the records in them, and where each epoch ended."""

    def __init__(self, make_loader: Callable[[], Any], max_bytes: int | None = None) -> None:
        self._make = make_loader
        self.max_bytes = KEPT_BYTES if max_bytes is None else max_bytes
        # (position, batch, records, bytes) in the order kept, the oldest first: all a step of the probe's
        # loop does is append one (and let the oldest go past the cap); the index by position is built when a
        # replay first asks (`batches`, `records`), and kept up to date from then on
        self._kept: deque[tuple[tuple[int, int], Any, list[int] | None, int]] = deque()
        self._index: dict[tuple[int, int], tuple[tuple[int, int], Any, list[int] | None, int]] | None = None
        self.ends: dict[int, int] = {}  # epoch -> its number of batches, where its end was seen
        self.nbytes = 0
        self.cap: int | None = None  # set by the first batch (KEPT_FLOOR)
        self.evicted = 0  # batches let go to stay within max_bytes
        self.loaders = 0  # loaders made for replays (the probe's own not counted)
        self.stream: str | None = None  # why the loader cannot be re-read the same way
        self._open: dict[int, tuple[Any, int]] = {}  # epoch -> a replay's loader left open, its next position
        self._own: dict[tuple[int, int], tuple[Any, ...]] = {}  # the kept entries the training's loop read
        self._epochs = 0

    def recording(self) -> Any:
        """The probe loop's `make_loader`: the user's loader, with what it yields kept."""
        epoch = self._epochs
        self._epochs += 1
        return _Recording(self._make(), self, epoch)

    def keep(self, pos: tuple[int, int], batch: Any, records: list[int] | None, reread: bool = False) -> None:
        """Keep a batch (a reference, no copy), the oldest let go past the cap: O(1) but for its size. A batch a
        replay re-read (`reread`) is kept only where that lets go of no batch at a later position: those are
        the training's own, which the replay is about to check the loader against (a stream) and read."""
        size = batch_nbytes(batch)
        cap = self.cap
        if cap is None:
            cap = self.cap = min(self.max_bytes, max(KEPT_FLOOR, size))
        if size > cap:
            self.evicted += 1
            return
        if reread and not self._room_before(pos, size, cap):
            return
        entry = (pos, batch, records, size)
        self._kept.append(entry)
        if not reread:
            self._own[pos] = entry
        if self._index is not None:
            self._index[pos] = entry
        self.nbytes += size
        while self.nbytes > cap:  # the oldest kept first: replays start near the fault
            old = self._kept.popleft()
            self.nbytes -= old[3]
            if self._index is not None and self._index.get(old[0]) is old:
                del self._index[old[0]]
            if self._own.get(old[0]) is old:
                del self._own[old[0]]
            self.evicted += 1

    def _room_before(self, pos: tuple[int, int], size: int, cap: int) -> bool:
        """Whether `size` more bytes fit by letting go only of kept batches at positions before `pos`."""
        need = self.nbytes + size - cap
        for entry in self._kept:
            if need <= 0:
                break
            if entry[0] > pos:
                return False
            need -= entry[3]
        return True

    def _by_pos(self) -> dict[tuple[int, int], tuple[tuple[int, int], Any, list[int] | None, int]]:
        """The kept entries by position, built on a replay's first question (the loop never asks)."""
        if self._index is None:
            self._index = {entry[0]: entry for entry in self._kept}
        return self._index

    @property
    def batches(self) -> Mapping[tuple[int, int], Any]:
        """The kept batches by (epoch, batch_index)."""
        return _Column(self._by_pos(), 1)

    @property
    def records(self) -> Mapping[tuple[int, int], list[int]]:
        """The dataset indices of the kept batches a batch sampler gave (for dropping a bad record)."""
        return _Column(self._by_pos(), 2)

    def read_by_training(self, pos: tuple[int, int], batch: Any) -> bool:
        """Whether `batch` is the very batch the training's loop read at `pos` (kept, not re-read)."""
        entry = self._own.get(pos)
        return entry is not None and entry[1] is batch

    def kept_from(self) -> tuple[int, int] | None:
        """The earliest kept position (None: nothing kept)."""
        return min(self._by_pos()) if self._kept else None

    def read(self, epoch: int, index: int, epoch_rng: dict[int, Any]) -> Iterator[tuple[int, int, Any]]:
        """(epoch, batch_index, batch) from the position on, with `END` where an epoch ended; kept batches
        as they are, the rest from one fresh loader per epoch. Stops where the data ends for the replay."""
        e, b = epoch, index
        kept = self._by_pos()
        while True:
            entry = kept.get((e, b))
            if entry is not None:
                yield e, b, entry[1]
                b += 1
            elif self.ends.get(e) == b:
                yield e, b, END
                e, b = e + 1, 0
            elif self.stream is not None:
                return
            else:
                for n, batch in self._reread(e, b, epoch_rng.get(e)):
                    yield e, n, batch
                if self.stream is not None or self.ends.get(e) is None:
                    return
                b = self.ends[e]

    def _reread(self, epoch: int, start: int, rng: Any) -> Iterator[tuple[int, Any]]:
        """Batches `start`.. of the loader for `epoch`: the one an earlier replay left open where it stopped
        (each position is read once for all replays), else a fresh one, made with the RNG the probe made that
        epoch's with (its shuffle order), the training's own RNG put back after (an epoch the probe never made
        draws from the training's RNG, as the training would). The kept batches before `start` must come
        again, or the loader is a stream and nothing it yields is used."""
        opened = self._open.pop(epoch, None)
        fresh = opened is None or opened[1] > start  # (a kept batch let go in between: start over)
        if opened is not None and fresh:
            stop_loader(opened[0])
            opened = None  # a generator holds the last batch it yielded: not alive through this whole replay
        saved = _rng_now()
        if fresh:
            if rng is not None:
                rng.restore()
            self.loaders += 1
            it, n = iter(_Recording(self._make(), self, epoch, keep=False)), 0
        else:
            it, n = opened  # type: ignore[misc]
            opened = None
        try:
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    self.ends[epoch] = n
                    return
                finally:
                    if fresh and n == 0 and rng is not None:  # a sampler draws its order with the first batch
                        _rng_restore(saved)
                pos = (epoch, n)
                entry = self._by_pos().get(pos)
                if entry is not None:
                    if not same(batch, entry[1]):
                        self.stream = (f"the loader did not yield batch {n} of epoch {epoch} again as the training "
                                       "read it (a stream, or an order that is not seeded)")
                        return
                elif n >= start:  # (a batch skipped on the way is not kept: it would push out newer ones)
                    self.keep(pos, batch, it.last_records, reread=True)
                if n >= start:
                    try:
                        yield n, batch if entry is None else entry[1]
                    except GeneratorExit:  # the replay is done: the next one goes on from here
                        self._open[epoch] = (it, n + 1)
                        it = None
                        raise
                n += 1
        finally:
            if it is not None:
                stop_loader(it)

    def close(self) -> None:
        """End the loaders left open for the next replay (a DataLoader's workers)."""
        for it, _ in self._open.values():
            stop_loader(it)
        self._open.clear()


class _Column(Mapping):  # type: ignore[type-arg]
    """One field of the kept entries by position (the batches, or the records a batch sampler gave), read
    through without a copy; a position without records is not in the records."""

    def __init__(self, entries: dict[tuple[int, int], tuple[Any, ...]], column: int) -> None:
        self._entries, self._column = entries, column

    def __getitem__(self, pos: tuple[int, int]) -> Any:
        value = self._entries[pos][self._column]
        if value is None and self._column == 2:
            raise KeyError(pos)
        return value

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return (pos for pos, entry in self._entries.items() if self._column != 2 or entry[2] is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Recording:
    """The user's loader; its iterator keeps each batch (and its batch sampler's indices) on the tape."""

    def __init__(self, loader: Any, tape: BatchTape, epoch: int, keep: bool = True) -> None:
        self.loader, self.tape, self.epoch, self.keep = loader, tape, epoch, keep
        self.it: Any = None
        self.n = 0
        self.last_records: list[int] | None = None
        self._indices: list[list[int]] | None = None

    def __iter__(self) -> _Recording:
        inner = getattr(self.loader, "_loader", self.loader)  # a GuardedLoader's DataLoader
        sampler = getattr(inner, "batch_sampler", None)
        if sampler is not None and not _iterable_dataset(inner):
            self._indices = []
            inner.batch_sampler = _Indices(sampler, self._indices)  # read once, by the iterator made below
            try:
                self.it = iter(self.loader)
            finally:
                inner.batch_sampler = sampler
        else:
            self.it = iter(self.loader)
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.it)
        except StopIteration:
            if self.keep:  # the epoch's end, where the training saw it
                self.tape.ends[self.epoch] = self.n
            raise
        n = self.n
        idx = self._indices
        if idx is not None:
            self.last_records = records = [int(i) for i in idx[n]] if n < len(idx) else None
        else:
            records = None  # (last_records stays None: a loader without a batch sampler has none)
        if self.keep:
            self.tape.keep((self.epoch, n), batch, records)
        self.n = n + 1
        return batch

    def __len__(self) -> int:  # as the user's loader (a TypeError for one without a length)
        return len(self.loader)

    def _try_shutdown_all(self) -> None:  # interrupt.stop_loader: the DataLoader's workers end now
        stop_loader(self.it)

    def __getattr__(self, name: str) -> Any:
        if name == "it":
            raise AttributeError(name)
        return getattr(self.it, name)


class _Indices:
    """A batch sampler that also appends each batch's indices to a list (in the order batches come)."""

    def __init__(self, inner: Any, out: list[list[int]]) -> None:
        self.inner, self.out = inner, out

    def __iter__(self) -> Iterator[Any]:
        for indices in self.inner:
            self.out.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _iterable_dataset(loader: Any) -> bool:
    import paddle

    return isinstance(getattr(loader, "dataset", None), paddle.io.IterableDataset)


def _leaves(batch: Any) -> list[Any]:
    if isinstance(batch, dict):
        return [x for k in sorted(batch, key=str) for x in _leaves(batch[k])]
    if isinstance(batch, (list, tuple)):
        return [x for v in batch for x in _leaves(v)]
    return [batch]


def batch_nbytes(batch: Any) -> int:
    """The bytes a batch holds (its arrays and tensors; 64 for anything else). Every step: a tuple or list of
    arrays (the usual batch) is summed in one loop, without a call per array."""
    if isinstance(batch, np.ndarray):
        return batch.nbytes
    if isinstance(batch, (list, tuple)):
        n = 0
        for v in batch:
            n += v.nbytes if type(v) is np.ndarray else batch_nbytes(v)
        return n
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    size = getattr(batch, "element_size", None)
    if size is not None:
        n = 1
        for d in batch.shape:
            n *= d
        return n * size()
    return 64


def same(a: Any, b: Any) -> bool:
    """Whether two batches hold the same values (NaN equal to NaN), compared a chunk of rows at a time: no
    copy of either batch (a tensor's rows reach the host a few MB at a time)."""
    from nandoctor.tensors.convert import to_numpy

    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if x is y:
            continue
        if not (_is_array(x) and _is_array(y)):
            ax, ay = to_numpy(x), to_numpy(y)
            if ax is None or ay is None:
                if ax is not ay and x != y:
                    return False
                continue
            if ax.shape != ay.shape or not np.array_equal(ax, ay, equal_nan=ax.dtype.kind in "fc"):
                return False
            continue
        if tuple(x.shape) != tuple(y.shape):
            return False
        for cx, cy in zip(_chunks(x), _chunks(y)):
            if cx.shape != cy.shape or not np.array_equal(cx, cy, equal_nan=cx.dtype.kind in "fc"):
                return False
    return True


def _is_array(value: Any) -> bool:
    """A numpy array or a tensor with a first axis (compared by chunks of rows)."""
    shape = getattr(value, "shape", None)
    return (isinstance(value, np.ndarray) or hasattr(value, "numpy")) and shape is not None and len(shape) > 0


def _chunks(value: Any) -> Iterator[np.ndarray]:
    from nandoctor.tensors.finite import row_chunks

    return (rows for _, rows in row_chunks(value))


def _rng_now() -> tuple[Any, Any, Any]:
    import paddle

    return paddle.get_rng_state(), np.random.get_state(), random.getstate()


def _rng_restore(state: tuple[Any, Any, Any]) -> None:
    import paddle

    paddle.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])
