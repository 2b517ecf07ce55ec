"""Seeded regression data with unnormalised features (standard deviation 30) and an exact linear target."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 40, batch_size: int = 64, scale: float = 30.0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    w = rng.normal(size=4)
    out = []
    for _ in range(batches):
        x = scale * rng.normal(size=(batch_size, 4))
        y = (x @ w).reshape(-1, 1)
        out.append((x.astype("float32"), y.astype("float32")))
    return out
