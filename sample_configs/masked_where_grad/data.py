"""Seeded positive (log-normal) features; one batch holds samples with an exact zero."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 20, batch_size: int = 8, bad_batch: int = 7,
                 bad_samples: tuple[int, ...] = (2, 6)) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    out = []
    for b in range(batches):
        x = rng.lognormal(size=(batch_size, 5)).astype("float32")
        target = np.log(x).sum(axis=1).astype("float32") * 0.3
        if b == bad_batch:
            for s in bad_samples:
                x[s, 1] = 0.0
        out.append((x, target))
    return out
