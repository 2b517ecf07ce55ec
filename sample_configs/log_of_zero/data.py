"""Synthetic, seeded tabular data; one batch carries two samples with a feature in the wrong unit."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 40, batch_size: int = 16, bad_batch: int = 12,
                 bad_samples: tuple[int, ...] = (3, 11)) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    w = rng.normal(size=8).astype("float32")
    out = []
    for b in range(batches):
        x = rng.normal(size=(batch_size, 8)).astype("float32")
        if b == bad_batch:
            for s in bad_samples:
                x[s, 2] = 1000.0 * abs(x[s, 2]) + 800.0  # logged in millivolts instead of volts
        y = (x @ w > 0).astype("float32")
        out.append((x, y))
    return out
