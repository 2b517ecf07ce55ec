"""Seeded token-id sequences with padding id 0; one batch holds empty (all-padding) sequences."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 30, batch_size: int = 8, seq_len: int = 12, bad_batch: int = 9,
                 empty_samples: tuple[int, ...] = (2, 5)) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    out = []
    for b in range(batches):
        ids = rng.integers(1, 50, size=(batch_size, seq_len)).astype("int64")
        lengths = rng.integers(3, seq_len + 1, size=batch_size)
        ids[np.arange(seq_len)[None, :] >= lengths[:, None]] = 0
        if b == bad_batch:
            ids[list(empty_samples)] = 0
        label = (ids.sum(axis=1) % 3).astype("int64")
        out.append((ids, label))
    return out
