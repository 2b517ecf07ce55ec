"""Seeded features with Poisson counts whose log-rate is linear in the features."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 10, batch_size: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(9)
    w = (0.1 * rng.normal(size=32)).astype("float32")
    out = []
    for _ in range(batches):
        x = rng.normal(size=(batch_size, 32)).astype("float32")
        counts = rng.poisson(np.exp(x @ w + 1.0)).astype("float32")
        out.append((x, counts))
    return out
