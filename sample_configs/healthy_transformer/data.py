"""Seeded token sequences; the class is whether token 1 occurs more often than token 2."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 24, batch_size: int = 16, seq_len: int = 16
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(16)
    out = []
    for _ in range(batches):
        ids = rng.integers(1, 32, size=(batch_size, seq_len)).astype("int64")
        label = rng.integers(0, 2, size=batch_size).astype("int64")
        for i, c in enumerate(label):
            ids[i, rng.choice(seq_len, size=4, replace=False)] = 1 if c == 1 else 2
        out.append((ids, label))
    return out
