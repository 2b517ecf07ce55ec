"""Seeded standardised features; in one batch some records are missing and stored as all-zero rows."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 16, batch_size: int = 8, features: int = 8, bad_batch: int = 6,
                 bad_samples: tuple[int, ...] = (3,)) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    w = rng.normal(size=features).astype("float32")
    out = []
    for b in range(batches):
        x = rng.normal(size=(batch_size, features)).astype("float32")
        if b == bad_batch:
            x[list(bad_samples)] = 0.0
        y = (np.tanh(x @ w) + 0.1 * rng.normal(size=batch_size)).astype("float32")
        out.append((x, y))
    return out
