"""Seeded pairs (a, b) with a target distance; one pair in one batch is an exact duplicate."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 20, batch_size: int = 8, bad_batch: int = 6,
                 duplicate_sample: int = 3) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(2)
    out = []
    for i in range(batches):
        a = rng.normal(size=(batch_size, 10)).astype("float32")
        b = a + rng.normal(scale=0.5, size=a.shape).astype("float32")
        if i == bad_batch:
            b[duplicate_sample] = a[duplicate_sample]
        target = np.linalg.norm(a - b, axis=1).astype("float32")
        out.append((a, b, target))
    return out
