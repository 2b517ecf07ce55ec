"""Loaders for the records tests (test_remedy_records.py): one bad record among 64, every epoch, in three
shapes a user writes: a plain list of batches, a generator, and a paddle.io.DataLoader with shuffle=True.

Each epoch's order is drawn from numpy's global RNG (the list and the generator) or from the DataLoader's
sampler, so the bad record comes back every epoch, at another position. Referenced from specs as
"<this file>:<callable>".
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import paddle

RECORDS, BATCH, BAD = 64, 16, 21


def records(bad: int = BAD) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): feature 2 of record `bad` logged in the wrong unit (x1000), so its logit saturates sigmoid."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=8).astype("float32")
    x = rng.normal(size=(RECORDS, 8)).astype("float32")
    x[bad, 2] = 1000.0 * abs(x[bad, 2]) + 800.0
    return x, (x @ w > 0).astype("float32")


def _batches(bad: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    x, y = records(bad)
    order = np.random.permutation(RECORDS)  # this epoch's shuffle
    for start in range(0, RECORDS, BATCH):
        idx = order[start:start + BATCH]
        yield x[idx], y[idx]


def list_loader(bad: int = BAD) -> list[tuple[np.ndarray, np.ndarray]]:
    """A plain list of (x, y) batches, reshuffled each time it is built (once an epoch): no batch sampler."""
    return list(_batches(bad))


def generator_loader(bad: int = BAD) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The same batches from a generator: no batch sampler, no length."""
    return _batches(bad)


class _Records(paddle.io.Dataset):
    def __init__(self, bad: int) -> None:
        self.x, self.y = records(bad)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return RECORDS


def shuffled_dataloader(bad: int = BAD) -> paddle.io.DataLoader:
    """A DataLoader with shuffle=True: its own BatchSampler names each sample by its dataset index."""
    return paddle.io.DataLoader(_Records(bad), batch_size=BATCH, shuffle=True)


def augmented_loader(batches: int = 20, bad_batch: int = 12, bad_rows: tuple[int, ...] = (3, 11)
                     ) -> list[tuple[np.ndarray, np.ndarray]]:
    """log_of_zero's records in a fixed order with an unseeded jitter (an augmentation drawn from fresh entropy):
    the bad rows fault at `bad_batch` on every read, but each read of the loader gives other values."""
    rng, jitter = np.random.default_rng(0), np.random.default_rng()
    w = rng.normal(size=8).astype("float32")
    out = []
    for b in range(batches):
        x = rng.normal(size=(BATCH, 8)).astype("float32")
        if b == bad_batch:
            x[list(bad_rows), 2] = 1000.0 * np.abs(x[list(bad_rows), 2]) + 800.0
        y = (x @ w > 0).astype("float32")
        out.append(((x + jitter.normal(scale=0.01, size=x.shape)).astype("float32"), y))
    return out
