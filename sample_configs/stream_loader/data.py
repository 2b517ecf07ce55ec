"""A stream of records (a queue, a socket, a log being tailed): each loader goes on from where the last stopped.

`READS` counts the records read, so a test can see how often the stream was read.
"""

from __future__ import annotations

import numpy as np
import paddle

READS = [0]
_POSITION = [0]  # the stream's read position: it survives a new loader, as a consumer's offset does
_TOTAL = 2000  # records in the stream


def _record(i: int, bad: set[int]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(i)
    w = np.random.default_rng(10_000).normal(size=8).astype("float32")
    x = rng.normal(size=8).astype("float32")
    if i in bad:
        x[2] = 1000.0 * abs(x[2]) + 800.0  # logged in millivolts instead of volts
    y = np.float32(x @ w > 0)
    return x, np.asarray(y, dtype="float32")


class Stream(paddle.io.IterableDataset):
    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def __iter__(self):
        while _POSITION[0] < _TOTAL:
            i = _POSITION[0]
            _POSITION[0] += 1
            READS[0] += 1
            yield _record(i, self.bad)


def build_loader(batch_size: int = 16, bad_batch: int = 12, bad_samples: tuple[int, ...] = (3, 11)):
    bad = {bad_batch * batch_size + s for s in bad_samples}
    return paddle.io.DataLoader(Stream(bad), batch_size=batch_size)
