"""Seeded feature records with class labels; two records of one batch are all zeros (a failed sensor read)."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 10, batch_size: int = 8, bad_batch: int = 4,
                 bad_rows: tuple[int, ...] = (2, 5)) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(batches):
        x = rng.normal(size=(batch_size, 8)).astype("float32")
        if i == bad_batch:
            x[list(bad_rows)] = 0.0
        y = rng.integers(0, 3, size=(batch_size,)).astype("int64")
        out.append((x, y))
    return out
