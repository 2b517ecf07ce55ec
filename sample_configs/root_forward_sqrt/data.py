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
