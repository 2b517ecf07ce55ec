"""Seeded regression data with features on a scale of ~3 (not standardised)."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 40, batch_size: int = 32) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    w = rng.normal(size=10).astype("float32")
    out = []
    for _ in range(batches):
        x = (3.0 * rng.normal(size=(batch_size, 10))).astype("float32")
        y = (x @ w + rng.normal(size=batch_size)).astype("float32").reshape(-1, 1)
        out.append((x, y))
    return out
