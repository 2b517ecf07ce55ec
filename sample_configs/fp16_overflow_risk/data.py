"""Seeded raw 8-bit spectra (values 0..255, as float32); the class sets which band is bright."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 20, batch_size: int = 16) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(13)
    out = []
    for _ in range(batches):
        label = rng.integers(0, 3, size=batch_size).astype("int64")
        x = rng.integers(0, 120, size=(batch_size, 64)).astype("float32")
        for i, c in enumerate(label):
            x[i, c * 16:(c + 1) * 16] = rng.integers(150, 256, size=16)
        out.append((x, label))
    return out
