"""Seeded 5-class data; one sample of one batch carries label 5 (a class the model does not have)."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 12, batch_size: int = 8, bad_batch: int = 3, bad_sample: int = 5,
                 bad_label: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(14)
    centers = rng.normal(size=(5, 10)).astype("float32")
    out = []
    for b in range(batches):
        label = rng.integers(0, 5, size=batch_size).astype("int64")
        x = (centers[label] + 0.5 * rng.normal(size=(batch_size, 10))).astype("float32")
        if b == bad_batch:
            label[bad_sample] = bad_label
        out.append((x, label))
    return out
