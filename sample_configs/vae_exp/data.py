"""Seeded standard-normal features; one sample of one batch is 1000x too large."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 30, batch_size: int = 16, bad_batch: int = 10,
                 bad_samples: tuple[int, ...] = (3,)) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for b in range(batches):
        x = rng.normal(size=(batch_size, 16)).astype("float32")
        if b == bad_batch:
            for s in bad_samples:
                x[s] *= 1000.0
        out.append(x)
    return out
