"""A map-style dataset with one bad record, shuffled each epoch by a BatchSampler.

`GETITEM` counts `__getitem__` calls, so a test can see how often the dataset was read.
"""

from __future__ import annotations

import numpy as np
import paddle

GETITEM = [0]


class Records(paddle.io.Dataset):
    def __init__(self, records: int, bad_record: int) -> None:
        rng = np.random.default_rng(0)
        w = rng.normal(size=8).astype("float32")
        self.x = rng.normal(size=(records, 8)).astype("float32")
        self.x[bad_record, 2] = 1000.0 * abs(self.x[bad_record, 2]) + 800.0  # millivolts instead of volts
        self.y = (self.x @ w > 0).astype("float32")

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        GETITEM[0] += 1
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


def build_loader(records: int = 96, batch_size: int = 16, bad_record: int = 37) -> paddle.io.DataLoader:
    data = Records(records, bad_record)
    sampler = paddle.io.BatchSampler(data, batch_size=batch_size, shuffle=True)
    return paddle.io.DataLoader(data, batch_sampler=sampler)
