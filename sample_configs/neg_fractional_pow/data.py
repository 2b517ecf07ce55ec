"""Seeded Poisson counts with a regression target; missing counts in one batch are stored as -1."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 20, batch_size: int = 8, bad_batch: int = 5,
                 bad_samples: tuple[int, ...] = (0, 4)) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(4)
    out = []
    for b in range(batches):
        counts = rng.poisson(5.0, size=(batch_size, 6)).astype("float32")
        target = np.sqrt(counts).mean(axis=1).astype("float32")
        if b == bad_batch:
            for s in bad_samples:
                counts[s, 3] = -1.0  # "missing" sentinel
        out.append((counts, target))
    return out
