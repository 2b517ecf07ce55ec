"""Seeded token sequences with per-token tags; padding and unannotated tokens carry the tag -100."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 16, batch_size: int = 6, seq_len: int = 10,
                 empty_batch: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(6)
    out = []
    for b in range(batches):
        ids = rng.integers(1, 40, size=(batch_size, seq_len)).astype("int64")
        tags = (ids % 5).astype("int64")
        lengths = rng.integers(4, seq_len + 1, size=batch_size)
        tags[np.arange(seq_len)[None, :] >= lengths[:, None]] = -100
        if b == empty_batch:
            tags[:] = -100  # a batch of unannotated sequences
        out.append((ids, tags))
    return out
