"""Seeded small counts per record and a target; one record of one batch stores its missing counts as -1."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 10, batch_size: int = 8, bad_batch: int = 5,
                 bad_row: int = 6) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(4)
    out = []
    for i in range(batches):
        counts = rng.integers(0, 3, size=(batch_size, 6)).astype("float32")
        if i == bad_batch:
            counts[bad_row] = -1.0  # every count missing, stored as the sentinel -1: the total is -6
        target = np.sqrt(np.clip(counts.sum(axis=1), 0, None)).astype("float32")
        out.append((counts, target))
    return out


def build_pairs(batches: int = 10, batch_size: int = 8, bad_batch: int = 3,
                duplicate: int = 2) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Pairs (a, b) and a target distance; pair `duplicate` of batch `bad_batch` is one item twice."""
    rng = np.random.default_rng(6)
    out = []
    for i in range(batches):
        a = rng.normal(size=(batch_size, 6)).astype("float32")
        b = (a + rng.normal(scale=0.5, size=a.shape)).astype("float32")
        if i == bad_batch:
            b[duplicate] = a[duplicate]
        out.append((a, b, np.linalg.norm(a - b, axis=1).astype("float32")))
    return out
