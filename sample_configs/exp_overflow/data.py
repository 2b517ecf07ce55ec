"""Seeded 4-class data; one batch holds two samples whose features were never normalised."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 24, batch_size: int = 8, bad_batch: int = 8,
                 bad_samples: tuple[int, ...] = (1, 4)) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    centers = rng.normal(size=(4, 12)).astype("float32")
    out = []
    for b in range(batches):
        label = rng.integers(0, 4, size=batch_size).astype("int64")
        x = (centers[label] + 0.5 * rng.normal(size=(batch_size, 12))).astype("float32")
        if b == bad_batch:
            x[list(bad_samples)] *= 1000.0
        out.append((x, label))
    return out
