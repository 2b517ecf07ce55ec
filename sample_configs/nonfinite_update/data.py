"""Seeded 3-class data over 6 channels; channel 5 is a reserved slot, always exactly 0."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 20, batch_size: int = 16) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(10)
    centers = rng.normal(size=(3, 6)).astype("float32")
    centers[:, 5] = 0.0
    out = []
    for _ in range(batches):
        label = rng.integers(0, 3, size=batch_size).astype("int64")
        x = (centers[label] + 0.5 * rng.normal(size=(batch_size, 6))).astype("float32")
        x[:, 5] = 0.0  # reserved channel, never filled
        out.append((x, label))
    return out
